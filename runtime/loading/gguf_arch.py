"""What a GGUF's metadata and tensor names mean for each architecture we serve: the
`ModelConfig` its `{arch}.*` keys describe and the Hugging Face name of each tensor. An
architecture, a tensor or a rope scaling we do not serve is refused by name.
"""
from __future__ import annotations

import math
import re

from contract.config import ModelConfig
from contract.errors import ModelLoadError

ARCHITECTURES = ("llama", "qwen2", "mistral")
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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def config_from_metadata(meta: dict, tensors: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {ARCHITECTURES})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"unsupported rope scaling {scaling!r}")

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"missing GGUF metadata key {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab or tensors["token_embd.weight"].shape[0]),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
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
    )


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


def hf_name(gguf_name: str, path: str = "") -> str:
    """Hugging Face name of a GGUF tensor name; unknown tensors are refused, not dropped."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ModelLoadError(f"{path}: unsupported tensor {gguf_name!r}")
