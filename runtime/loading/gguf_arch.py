"""What a GGUF's metadata and tensor names mean for each architecture we serve: the
`ModelConfig` its `{arch}.*` keys describe and the Hugging Face name of each tensor. An
architecture, a tensor or a rope scaling we do not serve is refused by name.
"""
from __future__ import annotations

import math
import re

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.rope import RopeScalingError, rope_from_gguf

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3")
# llama.cpp's converter interleaves Q/K rows for these (its rotary pairs adjacent dims)
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# where an architecture names a tensor differently (or has tensors Llama has not)
_ARCH_LAYER_NAMES = {
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight"},
    # Phi-3 keeps q/k/v and gate/up fused (gate first, as ours); its ffn_up is both
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    # Gemma 3's sandwich: attention's output and the MLP's are normalised too, and its
    # "ffn_norm" is the norm before the MLP (Llama's post_attention_layernorm)
    "gemma3": {"attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # read into the config's rope scaling at load (config_from_metadata); no model weight
    "rope_freqs.weight": "rope_freqs.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def config_from_metadata(meta: dict, tensors: dict,
                         rope_factors: tuple[float, ...] = ()) -> ModelConfig:
    """The config a GGUF's metadata describes; `rope_factors` are its `rope_freqs.weight`
    tensor's values (the caller reads them: Llama 3.1's llama3 scaling lives there)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {ARCHITECTURES})")
    if "rope_freqs.weight" in tensors and not rope_factors:
        raise ModelLoadError("the file's rope_freqs tensor (rope frequency factors) was not "
                             "read")
    try:
        rope = rope_from_gguf(meta, arch, rope_factors)
    except RopeScalingError as e:
        raise ModelLoadError(str(e)) from e

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"missing GGUF metadata key {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    layers = int(key("block_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    hidden = int(key("embedding_length"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab or tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        head_dim=meta.get(f"{arch}.attention.key_length"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(i for i in [meta.get("tokenizer.ggml.eos_token_id")] if i is not None),
        weight_format=_weight_format(tensors),
        rope_scaling=rope,
        **_family_traits(arch, meta, tensors, layers, hidden),
    )


def _family_traits(arch: str, meta: dict, tensors: dict, layers: int, hidden: int) -> dict:
    """The ModelConfig fields beyond Llama's that an architecture's file implies."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "phi3":
        window = int(meta.get("phi3.attention.sliding_window") or 0)
        return {"layer_windows": (window,) * layers if window else ()}
    if arch == "gemma3":
        # llama.cpp's own constants for Gemma 3: every sixth layer global, the others over
        # the window with rope base 10000, attention scaled by head_dim (the file stores norms
        # as 1 + w already)
        window = int(meta.get("gemma3.attention.sliding_window") or 0)
        windows = tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers))
        return {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
                "embedding_multiplier": math.sqrt(hidden),
                "layer_windows": windows if window else (),
                "rope_local_theta": 10000.0 if window else None,
                "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping")}
    return {}


def _weight_format(tensors: dict) -> str:
    """The GGUF type most matrices have, by element count (norms are always F32)."""
    from gguf import GGMLQuantizationType

    counts: dict[str, int] = {}
    for t in tensors.values():
        if len(t.shape) == 2:
            name = GGMLQuantizationType(t.ggml_type).name
            counts[name] = counts.get(name, 0) + math.prod(t.shape)
    top = max(counts, key=counts.__getitem__) if counts else "F32"
    return "float" if top in ("F32", "F16", "BF16") else top


def hf_name(gguf_name: str, path: str = "", arch: str = "llama") -> str:
    """Hugging Face name of a GGUF tensor name; unknown tensors are refused, not dropped."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if m.group(2) in names:
            return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise ModelLoadError(f"{path}: unsupported tensor {gguf_name!r}")
