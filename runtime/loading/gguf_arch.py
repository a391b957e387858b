"""What a GGUF's metadata and tensor names mean for each architecture we serve: the
`ModelConfig` its `{arch}.*` keys describe and the Hugging Face name of each tensor. An
architecture, a tensor or a rope scaling we do not serve is refused by name.

Mixtures of experts as llama.cpp's converter writes them: `qwen3moe`, `llama` with
`expert_count` (Mixtral) and `deepseek2` (DeepSeek-V2/V3, Multi-head Latent Attention). Their
config is the Hugging Face family's (`qwen3_moe`, `mixtral`, `deepseek_v2` / `deepseek_v3` by
the gating function), so the model code is the one the Hugging Face folders run. Each layer's
routed experts are one stacked 3-D tensor per projection (`ffn_{gate,up,down}_exps`, [E, N, K]
in torch order): `expert_names` names each expert's slice, which runtime/loading/gguf.py reads
as a matrix of its own (expert e's blocks are a contiguous byte range of the stack). A layer is
a MoE layer where the file has its router (`ffn_gate_inp`), so DeepSeek's leading dense layers
and Qwen's `mlp_only_layers` need no key. DeepSeek's keys follow either converter: the newer
writes the MLA cache's widths as `key_length` / `value_length` (kv_lora_rank + rope,
kv_lora_rank), one KV head, the per-head widths as `key_length_mla` / `value_length_mla`, and
splits `attn_kv_b` into `attn_k_b` (transposed) and `attn_v_b`; the older writes the per-head
widths as `key_length` / `value_length` and keeps `attn_kv_b`. Its YaRN keeps only DeepSeek's
`mscale_all_dim` (`rope.scaling.yarn_log_multiplier` = 0.1 x it) and llama.cpp runs it with the
rotary tables unscaled, i.e. as if `mscale` were the same: so is it read here.
"""
from __future__ import annotations

import dataclasses
import math
import re

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.rope import RopeScaling, RopeScalingError, rope_from_gguf

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3", "qwen3moe", "deepseek2")
# the architectures whose files may hold routed experts
EXPERT_ARCHITECTURES = ("llama", "qwen3moe", "deepseek2")
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
    "qwen3moe": {"attn_q_norm.weight": "self_attn.q_norm.weight",
                 "attn_k_norm.weight": "self_attn.k_norm.weight",
                 "ffn_gate_inp.weight": "mlp.gate.weight"},
    "llama": {"ffn_gate_inp.weight": "mlp.gate.weight"},  # Mixtral's router
    "deepseek2": {"attn_q_a.weight": "self_attn.q_a_proj.weight",
                  "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                  "attn_q_b.weight": "self_attn.q_b_proj.weight",
                  "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                  "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                  "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
                  "ffn_gate_inp.weight": "mlp.gate.weight",
                  "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                  "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"},
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
        if arch == "deepseek2":
            rope = _deepseek_rope(meta, rope)
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
    moe = _moe_traits(arch, meta, tensors, layers, key)
    latent = _latent_attention_traits(meta, tensors, key) if arch == "deepseek2" else {}
    return ModelConfig(
        architecture=_family(arch, moe),
        vocab_size=int(vocab or tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        # latent attention: every head reads the one latent (the file's head_count_kv is 1
        # in the newer converter's form, the heads in the older's)
        num_key_value_heads=heads if latent else int(key("attention.head_count_kv", heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        head_dim=latent.get("qk_rope_head_dim", meta.get(f"{arch}.attention.key_length")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(i for i in [meta.get("tokenizer.ggml.eos_token_id")] if i is not None),
        weight_format=_weight_format(tensors),
        rope_scaling=rope,
        **_family_traits(arch, meta, tensors, layers, hidden),
        **moe,
        **latent,
    )


def _family(arch: str, moe: dict) -> str:
    """The Hugging Face family the file's model is (the same model code serves both)."""
    if arch == "deepseek2":
        return "deepseek_v3" if moe.get("router") == "sigmoid_group_topk" else "deepseek_v2"
    if moe:
        return {"llama": "mixtral", "qwen3moe": "qwen3_moe"}[arch]
    return arch


# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType); 0: not written, which
# llama.cpp reads as softmax (DeepSeek-V2 files predate the key)
_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}


def _moe_traits(arch: str, meta: dict, tensors: dict, layers: int, key) -> dict:
    """The mixture-of-experts fields of ModelConfig ({} for a dense file); a gating function,
    a router or an expert layout we do not serve is refused by name."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    stacked = sorted(n for n in tensors if n.endswith(tuple(_EXPERT_PARTS)))
    if not experts:
        if stacked:
            raise ModelLoadError(f"tensor {stacked[0]} holds experts, but the file has no "
                                 f"{arch}.expert_count")
        return {}
    if arch not in EXPERT_ARCHITECTURES:
        raise ModelLoadError(f"{arch} with experts ({arch}.expert_count {experts}) is not "
                             f"served (experts are read for {', '.join(EXPERT_ARCHITECTURES)})")
    flags = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers))
    if not any(flags):
        raise ModelLoadError(f"{arch}.expert_count is {experts} but no layer has a router "
                             "tensor (blk.N.ffn_gate_inp.weight)")
    width = int(meta.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length"))
    traits: dict = {"num_experts": experts,
                    "experts_per_token": int(key("expert_used_count")),
                    "moe_intermediate_size": width, "moe_layers": flags}
    gating = int(meta.get(f"{arch}.expert_gating_func") or 0)
    if gating not in _GATING:
        raise ModelLoadError(f"{arch}.expert_gating_func {gating} is not served (softmax 1, "
                             "sigmoid 2)")
    if arch != "deepseek2":
        if _GATING[gating] != "softmax":
            raise ModelLoadError(f"{arch} with {_GATING[gating]} expert gating is not served")
        # llama.cpp weights Mixtral's and Qwen3-MoE's k experts normalised (softmax over the
        # top k logits; norm_topk_prob), unless a Qwen file says otherwise
        normalize = bool(meta.get(f"{arch}.expert_weights_norm", True))
        return {**traits, "router": "softmax_topk", "router_normalizes": normalize}
    return {**traits, **_deepseek_router(meta, tensors, _GATING[gating], width, flags)}


def _deepseek_router(meta: dict, tensors: dict, gating: str, width: int,
                     flags: tuple[bool, ...]) -> dict:
    """DeepSeek's router and shared experts: V3's sigmoid scores with the correction bias
    (`exp_probs_b`) and group-limited top-k, V2's softmax (group-limited where the file has
    groups), normalised or not, scaled by `expert_weights_scale`."""
    normalize = bool(meta.get("deepseek2.expert_weights_norm", False))
    groups = int(meta.get("deepseek2.expert_group_count") or 1)
    kept = int(meta.get("deepseek2.expert_group_used_count") or 1)
    biased = any(n.endswith(".exp_probs_b.bias") for n in tensors)
    if gating == "sigmoid":
        router = "sigmoid_group_topk"
    else:
        if biased:
            raise ModelLoadError("a router correction bias (exp_probs_b) with softmax gating "
                                 "is not served")
        if normalize:  # as runtime/loading/hf.py: DeepSeek-V2's references disagree
            raise ModelLoadError("expert_weights_norm with DeepSeek-V2's softmax router is "
                                 "not served")
        router = "softmax_group_topk" if groups > 1 else "softmax_topk"
    shared = int(meta.get("deepseek2.expert_shared_count") or 0)
    shared_width = int(meta.get("deepseek2.expert_shared_feed_forward_length")
                       or width * shared)
    first_moe = flags.index(True)
    leading = meta.get("deepseek2.leading_dense_block_count")
    if leading is not None and int(leading) != first_moe:
        raise ModelLoadError(f"deepseek2.leading_dense_block_count is {leading} but the "
                             f"first layer with a router is {first_moe}")
    return {"router": router, "router_normalizes": normalize,
            "routed_scaling_factor": float(meta.get("deepseek2.expert_weights_scale") or 1.0),
            "router_groups": groups if router != "softmax_topk" else 1,
            "router_groups_kept": kept if router != "softmax_topk" else 1,
            "shared_expert_intermediate_size": shared_width if shared else 0}


def _latent_attention_traits(meta: dict, tensors: dict, key) -> dict:
    """DeepSeek's Multi-head Latent Attention widths, from either converter's keys."""
    rope = int(key("rope.dimension_count"))
    if "deepseek2.attention.key_length_mla" in meta:  # newer: key_length is the cache row's
        qk = int(key("attention.key_length_mla"))
        v = int(key("attention.value_length_mla"))
    else:
        qk, v = int(key("attention.key_length")), int(key("attention.value_length"))
    q_rank = int(meta.get("deepseek2.attention.q_lora_rank") or 0)
    if bool(q_rank) != ("blk.0.attn_q_a.weight" in tensors):
        raise ModelLoadError(f"deepseek2.attention.q_lora_rank is {q_rank} but the file "
                             f"{'lacks' if q_rank else 'has'} blk.0.attn_q_a.weight")
    return {"kv_lora_rank": int(key("attention.kv_lora_rank")), "q_lora_rank": q_rank,
            "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope, "v_head_dim": v}


def _deepseek_rope(meta: dict, rope: RopeScaling) -> RopeScaling:
    """llama.cpp's DeepSeek YaRN: the softmax sharpened by (1 + yarn_log_multiplier ln s)^2
    (the converter writes 0.1 x mscale_all_dim), the rotary tables unscaled: DeepSeek's
    rule with mscale = mscale_all_dim."""
    if rope.type != "yarn":
        return rope
    if meta.get("deepseek2.rope.scaling.attn_factor", 1.0) != 1.0:
        raise ModelLoadError("deepseek2.rope.scaling.attn_factor other than 1 is not served")
    log_mul = meta.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if not log_mul:
        raise ModelLoadError("deepseek2 YaRN without rope.scaling.yarn_log_multiplier is not "
                             "served")
    m = float(log_mul) / 0.1
    return dataclasses.replace(rope, attention_factor=None, mscale=m, mscale_all_dim=m)


def _family_traits(arch: str, meta: dict, tensors: dict, layers: int, hidden: int) -> dict:
    """The ModelConfig fields beyond Llama's that an architecture's file implies."""
    if arch in ("qwen3", "qwen3moe"):
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
        if len(t.shape) >= 2:  # experts' stacks [E, N, K] count as their matrices
            name = GGMLQuantizationType(t.ggml_type).name
            counts[name] = counts.get(name, 0) + math.prod(t.shape)
    top = max(counts, key=counts.__getitem__) if counts else "F32"
    return "float" if top in ("F32", "F16", "BF16") else top


def hf_name(gguf_name: str, path: str = "", arch: str = "llama") -> str:
    """Hugging Face name of a GGUF tensor name; unknown tensors are refused, not dropped.
    (Stacked experts have one name per expert: `expert_names`.)"""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if m.group(2) in names:
            return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
        e = _OLD_EXPERT_RE.fullmatch(m.group(2))
        if e and arch == "llama":  # llama.cpp's first Mixtral files: one tensor per expert
            return (f"model.layers.{m.group(1)}.mlp.experts.{e.group(2)}."
                    f"{e.group(1)}_proj.weight")
    raise ModelLoadError(f"{path}: unsupported tensor {gguf_name!r}")


# a layer's stacked routed experts, [E, N, K] in torch order: the part each is
_EXPERT_PARTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                 "ffn_down_exps.weight": "down"}
_OLD_EXPERT_RE = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
# the newer DeepSeek converter's halves of kv_b_proj: K's part transposed, [H, rank, nope],
# and V's, [H, v, rank] (runtime/loading/gguf.py joins them back into kv_b_proj)
KV_B_HALVES = {"attn_k_b.weight": "k", "attn_v_b.weight": "v"}


def expert_names(gguf_name: str, shape: tuple[int, ...], config: ModelConfig, arch: str,
                 path: str = "") -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's slices, one per expert in order
    (None for any other tensor); a stack whose shape is not [experts, N, K] of the config's
    widths is refused by name."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m or m.group(2) not in _EXPERT_PARTS:
        return None
    if arch not in EXPERT_ARCHITECTURES or not config.num_experts:
        raise ModelLoadError(f"{path}: unsupported tensor {gguf_name!r} (experts in a "
                             f"{arch} file without expert_count)")
    part = _EXPERT_PARTS[m.group(2)]
    width, hidden = config.moe_intermediate_size, config.hidden_size
    want = (config.num_experts, *((hidden, width) if part == "down" else (width, hidden)))
    if tuple(shape) != want:
        raise ModelLoadError(f"{path}: tensor {gguf_name} has expert layout {list(shape)}, "
                             f"not [experts, N, K] = {list(want)}")
    layer = int(m.group(1))
    if not config.is_moe_layer(layer):
        raise ModelLoadError(f"{path}: tensor {gguf_name} holds experts in a layer without a "
                             "router (ffn_gate_inp)")
    return [f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
            for e in range(config.num_experts)]


def kv_b_half(gguf_name: str, arch: str) -> tuple[str, str] | None:
    """(kv_b_proj's Hugging Face name, "k" or "v") for the newer DeepSeek converter's split
    attn_k_b / attn_v_b, None for any other tensor."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if arch != "deepseek2" or not m or m.group(2) not in KV_B_HALVES:
        return None
    return f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight", KV_B_HALVES[m.group(2)]
