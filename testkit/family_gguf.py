"""A family's tiny random-weight model (testkit/family_models.py) written as llama.cpp's
converter writes its GGUF: the architecture's metadata keys, llama.cpp's tensor names, Q/K rows
interleaved where its rotary pairs adjacent dimensions (llama), Phi-3's fused q/k/v and
gate/up kept fused, Llama 3.1's llama3 rope scaling as a `rope_freqs` tensor of per-dimension
factors (the converter's formula), linear and YaRN scaling as `rope.scaling.*` keys, and the
tokenizer's BPE vocabulary. The transformers model that holds the same weights is the
reference (tests/runtime/test_family_gguf.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

ARCH = {"llama": "llama", "llama-linear": "llama", "llama3": "llama", "llama-yarn": "llama",
        "qwen3": "qwen3", "phi3": "phi3"}
PERMUTED = ("llama",)  # llama.cpp's converter interleaves these architectures' Q/K rows
# Hugging Face layer tensor -> llama.cpp's; Phi-3's fused ones under their own names
_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.qkv_proj.weight": "attn_qkv", "self_attn.q_norm.weight": "attn_q_norm",
          "self_attn.k_norm.weight": "attn_k_norm", "mlp.gate_proj.weight": "ffn_gate",
          "mlp.up_proj.weight": "ffn_up", "mlp.gate_up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_family_gguf(path: Path, family: str, model, tokenizer_json: Path,
                      matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
                      ) -> None:
    """Write `model` (a transformers model of `family`) to `path` as a GGUF whose 2-D
    weights are `matrix_type` (F32, F16 or a type `gguf.quants.quantize` writes); norms and
    rope factors stay F32, as llama.cpp's converter keeps them."""
    arch = ARCH[family]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _add_shape(writer, cfg)
    _add_rope(writer, cfg, family)
    _add_vocabulary(writer, tokenizer_json, cfg)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        gguf_name = _gguf_name(name)
        if arch in PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gguf_name \
                else cfg.num_key_value_heads
            w = _interleave(w, heads)
        add_tensor(writer, gguf_name, w, matrix_type)
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def file_weights(model, path: Path) -> None:
    """Give `model` the weights the file at `path` holds (its quantization undone), so it is
    the exact reference of a quantized file."""
    from runtime.loading.gguf import read_gguf

    _, weights, _ = read_gguf(str(path))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name].view(p.shape))


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
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


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
    """`w` as `kind` where it is a matrix (quantized by gguf's own quantizers), else F32."""
    Q = gguf.GGMLQuantizationType
    if w.ndim != 2 or kind == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif kind == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), kind),
                          raw_shape=gguf.quant_shape_to_byte_shape(w.shape, kind),
                          raw_dtype=kind)
