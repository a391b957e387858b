"""Output rows of the query/key projections reordered for our rotary kernel, which rotates
halves (x_i with x_{i + d/2}, Hugging Face's rotate_half): llama.cpp's converter interleaves a
Llama's Q/K rows (its rotary pairs adjacent dimensions), and DeepSeek rotates interleaved pairs
(x0, x1), (x2, x3), ... of each rotated part in its folders and GGUFs alike. Permuting the rows
that make each rotated part turns one rotation into the other; q and k both get it, so every
q . k is unchanged. The GGUF reader and the folder reader both call these."""
from __future__ import annotations

import torch

from contract.config import ModelConfig


def undo_llama_cpp_interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a llama.cpp Q or K matrix (or bias) of `heads` heads back in HF's order."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())


def _halves(rope: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def query_rows_in_halves(w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """DeepSeek's query projection (q_b_proj or q_proj, weight or bias): each head's rotated
    rows ([nope | rope] per head) from interleaved pairs to halves."""
    rope, nope = config.qk_rope_head_dim, config.qk_nope_head_dim
    per_head = w.reshape(config.num_attention_heads, nope + rope, *w.shape[1:]).clone()
    per_head[:, nope:] = per_head[:, nope:][:, _halves(rope)]
    return per_head.reshape(w.shape)


def latent_rows_in_halves(w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """DeepSeek's kv_a_proj_with_mqa (weight or bias): the shared rotated key's rows (the last
    qk_rope_head_dim, after the latent's) from interleaved pairs to halves."""
    out = w.clone()
    out[config.kv_lora_rank:] = w[config.kv_lora_rank:][_halves(config.qk_rope_head_dim)]
    return out
