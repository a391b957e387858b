"""A family's tiny random-weight model (testkit/family_models.py) written as llama.cpp's
converter writes its GGUF: the architecture's metadata keys, llama.cpp's tensor names, Q/K rows
interleaved where its rotary pairs adjacent dimensions (llama), Phi-3's fused q/k/v and
gate/up kept fused, Llama 3.1's llama3 rope scaling as a `rope_freqs` tensor of per-dimension
factors (the converter's formula), linear and YaRN scaling as `rope.scaling.*` keys, and the
tokenizer's BPE vocabulary. The transformers model that holds the same weights is the
reference (tests/runtime/test_family_gguf.py).

Mixtures of experts as the converter writes them (tests/runtime/test_moe_gguf.py): each layer's
routed experts stacked into one [E, N, K] tensor per projection (`ffn_{gate,up,down}_exps`,
torch order; GGUF's dimensions reversed), quantized like the other matrices, the router
(`ffn_gate_inp`) kept F32; `qwen3_moe` as `qwen3moe`, `mixtral` as `llama` with expert keys,
DeepSeek as `deepseek2`: MLA's tensors under llama.cpp's names in DeepSeek's own (interleaved)
rope order, the correction bias as `exp_probs_b.bias`, the shared experts as `ffn_*_shexp`,
the gating function and group keys, YaRN's `mscale_all_dim` as `yarn_log_multiplier` (0.1 x it;
the file has no `mscale`: `file_reference` gives the model it then describes). `split_kv_b`
writes the newer converter's form (kv_b_proj split into `attn_k_b`, transposed, and
`attn_v_b`; the MLA cache's widths as key_length / value_length, one KV head, the heads' as
`key_length_mla` / `value_length_mla`), else the older (`attn_kv_b`, per-head widths). A matrix
whose rows are not whole blocks of the type is written F16, as the converter falls back.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

ARCH = {"llama": "llama", "llama-linear": "llama", "llama3": "llama", "llama-yarn": "llama",
        "qwen3": "qwen3", "phi3": "phi3", "mixtral": "llama", "qwen3_moe": "qwen3moe",
        "deepseek_v3": "deepseek2", "deepseek_v2_lite": "deepseek2"}
DEEPSEEK = ("deepseek_v3", "deepseek_v2_lite")
PERMUTED = ("llama",)  # llama.cpp's converter interleaves these architectures' Q/K rows
# Hugging Face layer tensor -> llama.cpp's; Phi-3's fused ones under their own names
_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.qkv_proj.weight": "attn_qkv", "self_attn.q_norm.weight": "attn_q_norm",
          "self_attn.k_norm.weight": "attn_k_norm", "mlp.gate_proj.weight": "ffn_gate",
          "mlp.up_proj.weight": "ffn_up", "mlp.gate_up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
          "self_attn.q_a_proj.weight": "attn_q_a",
          "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
          "self_attn.q_b_proj.weight": "attn_q_b",
          "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
          "self_attn.kv_b_proj.weight": "attn_kv_b",
          "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
          "mlp.shared_experts.down_proj.weight": "ffn_down_shexp"}
# tensors of their own GGUF form: the stacked experts (transformers' in-memory names), the
# correction bias (a ".bias", as the converter renames it)
_STACKED = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
            "mlp.experts.down_proj": ("ffn_down_exps",)}
_KEPT_F32 = ("ffn_gate_inp",)  # llama.cpp keeps routers in float32
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_family_gguf(path: Path, family: str, model, tokenizer_json: Path,
                      matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                      split_kv_b: bool = True) -> None:
    """Write `model` (a transformers model of `family`) to `path` as a GGUF whose matrices
    are `matrix_type` (F32, F16 or a type `gguf.quants.quantize` writes); norms, routers and
    rope factors stay F32, as llama.cpp's converter keeps them. `split_kv_b`: DeepSeek's
    kv_b_proj in the newer converter's split form (see the module's text)."""
    arch = ARCH[family]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if family in DEEPSEEK:
        _add_deepseek_shape(writer, cfg, split_kv_b)
    else:
        _add_shape(writer, cfg)
    _add_experts(writer, cfg, family)
    _add_rope(writer, cfg, family)
    _add_vocabulary(writer, tokenizer_json, cfg)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        for gguf_name, part in _gguf_tensors(name, w, cfg, split_kv_b):
            if arch in PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = cfg.num_attention_heads if "attn_q" in gguf_name \
                    else cfg.num_key_value_heads
                part = _interleave(part, heads)
            kind = gguf.GGMLQuantizationType.F32 if gguf_name.split(".")[-2] in _KEPT_F32 \
                else matrix_type
            add_tensor(writer, gguf_name, part, kind)
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(name: str, w: np.ndarray, cfg, split_kv_b: bool
                  ) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors (name, array in torch order) the converter writes for one of the
    model's tensors."""
    prefix, _, rest = name.partition(".layers.")
    index, _, tail = rest.partition(".")
    if tail in _STACKED:  # transformers' [E, 2I, H] gate_up (gate first) / [E, H, I] down
        parts = _STACKED[tail]
        arrays = np.split(w, 2, axis=1) if len(parts) == 2 else [w]
        return [(f"blk.{index}.{p}.weight", np.ascontiguousarray(a))
                for p, a in zip(parts, arrays)]
    if tail == "mlp.gate.e_score_correction_bias":
        return [(f"blk.{index}.exp_probs_b.bias", w)]
    if tail == "self_attn.kv_b_proj.weight" and split_kv_b:
        heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        per_head = w.reshape(heads, nope + v, -1)
        k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))  # [H, rank, nope]
        return [(f"blk.{index}.attn_k_b.weight", k_b),
                (f"blk.{index}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))]
    return [(_gguf_name(name), w)]


def file_weights(model, path: Path) -> None:
    """Give `model` the weights the file at `path` holds (its quantization undone), so it is
    the exact reference of a quantized file. Read with gguf's own reader and dequantizers and
    mapped back through this writer's names and layouts, not through our loader."""
    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # torch order
        tensors[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                     dtype=np.float32).reshape(shape)
    cfg = model.config
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            value = _file_value(name, tuple(p.shape), tensors, cfg, arch)
            if value is not None:
                p.copy_(torch.from_numpy(np.array(value, dtype=np.float32)).view(p.shape))


def _file_value(name: str, shape: tuple[int, ...], tensors: dict, cfg, arch: str):
    """The file's value of one of the model's tensors, in the model's layout (None where the
    file has none: rotary buffers, an lm_head the file ties)."""
    prefix, _, rest = name.partition(".layers.")
    index, _, tail = rest.partition(".")
    if tail in _STACKED:
        return np.concatenate([tensors[f"blk.{index}.{p}.weight"] for p in _STACKED[tail]],
                              axis=1)
    if tail == "mlp.gate.e_score_correction_bias":
        return tensors[f"blk.{index}.exp_probs_b.bias"]
    if tail == "self_attn.kv_b_proj.weight" and f"blk.{index}.attn_k_b.weight" in tensors:
        k_b = tensors[f"blk.{index}.attn_k_b.weight"].transpose(0, 2, 1)
        return np.concatenate([k_b, tensors[f"blk.{index}.attn_v_b.weight"]],
                              axis=1).reshape(shape)
    try:
        gguf_name = _gguf_name(name)
    except ValueError:
        return None
    if gguf_name not in tensors:
        return None
    w = tensors[gguf_name]
    if arch in PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
        w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)
    return w


def file_reference(model, family: str):
    """The transformers model a file written from `model` describes: `model` itself, except
    for DeepSeek's YaRN with `mscale` other than `mscale_all_dim`, which llama.cpp's file
    cannot hold (only `yarn_log_multiplier`, from mscale_all_dim, and llama.cpp's rotary
    tables are unscaled, i.e. mscale = mscale_all_dim): the same weights with that mscale."""
    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    if family not in DEEPSEEK or rope.get("rope_type") != "yarn" \
            or rope.get("mscale") == rope.get("mscale_all_dim"):
        return model
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**rope, "mscale": rope["mscale_all_dim"]}
    twin = type(model)(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def llama3_rope_factors(cfg) -> np.ndarray:
    """Llama 3.1's scaling as per-dimension factors, by llama.cpp's converter's formula: long
    wavelengths slowed by the factor, short ones kept, the blend between as 1 / its ratio."""
    rope = cfg.rope_parameters
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                          / head_dim))
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_shape(writer: gguf.GGUFWriter, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _add_common_shape(writer, cfg)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)


def _add_common_shape(writer: gguf.GGUFWriter, cfg) -> None:
    """The keys every family's converter writes alike."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _add_deepseek_shape(writer: gguf.GGUFWriter, cfg, split_kv_b: bool) -> None:
    """DeepSeek's keys as the converter's deepseek2 writes them (either form, module text)."""
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    _add_common_shape(writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split_kv_b:  # MLA as one-KV-head attention over the latent
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + rope)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:
        writer.add_head_count_kv(cfg.num_attention_heads)
        writer.add_key_length(cfg.qk_nope_head_dim + rope)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_rope_dimension_count(rope)


def _add_experts(writer: gguf.GGUFWriter, cfg, family: str) -> None:
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) \
        or getattr(cfg, "n_routed_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "mixtral":
        return  # llama: the experts' width is feed_forward_length
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family not in DEEPSEEK:
        return
    writer.add_expert_shared_count(cfg.n_shared_experts or 0)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if getattr(cfg, "n_group", None) is not None:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    # DeepSeek-V3's config.json says scoring_func "sigmoid" (transformers' class implies it),
    # V2's "softmax"
    sigmoid = family == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid
                                  else gguf.ExpertGatingFuncType.SOFTMAX)


def _add_rope(writer: gguf.GGUFWriter, cfg, family: str) -> None:
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
        if family in DEEPSEEK and rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    elif kind not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise ValueError(f"{family}: no GGUF form written for rope type {kind!r}")


def _add_vocabulary(writer: gguf.GGUFWriter, tokenizer_json: Path, cfg) -> None:
    """The tokenizer's byte-level BPE vocabulary in id order, added tokens as control."""
    spec = json.loads(Path(tokenizer_json).read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "vocabulary ids have gaps"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    prefix, _, rest = hf.partition(".layers.")
    index, _, tail = rest.partition(".")
    if prefix != "model" or tail not in _LAYER:
        raise ValueError(f"no llama.cpp name for {hf!r}")
    return f"blk.{index}.{_LAYER[tail]}.weight"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: each head's two rotated halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray,
               kind: gguf.GGMLQuantizationType) -> None:
    """`w` as `kind` where it is a matrix or a stack of them (quantized by gguf's own
    quantizers), else F32; F16 where its rows are not whole blocks of `kind`."""
    Q = gguf.GGMLQuantizationType
    if kind not in (Q.F32, Q.F16) and w.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = Q.F16
    if w.ndim < 2 or kind == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif kind == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), kind),
                          raw_shape=gguf.quant_shape_to_byte_shape(w.shape, kind),
                          raw_dtype=kind)
