"""Sliding-window attention over the paged cache (Gemma 3's local layers, Mistral's window).

A query at position p sees the keys at positions p - window + 1 .. p. While every context of a
step fits in the window that is plain causal attention, and the layer runs the usual kernels
(runtime/models/attention.py); a step that reaches past the window runs the C kernels with
their window where they run (kernels/cpu/attention.c), else comes here. This is
the reference form: each sequence's visible keys gathered from its block table and one
scaled-dot-product call with the window's mask, correct on any device, not the fastest
(the Triton kernels have no window yet). Every block stays allocated: windowed and global
layers share one block table, so the prefix cache, the disk tier and PD transfers see the same
blocks for both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_int8


def _slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    return table[positions // page].long() * page + positions % page


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
            page: int, q_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions q_pos [n] of one sequence, against its keys in the window."""
    lo = max(int(q_pos[0]) - window + 1, 0)
    keys = torch.arange(lo, int(q_pos[-1]) + 1, device=q.device)
    slots = _slots(table, keys, page)
    k = kv_int8.widen(k_cache.index_select(0, slots), k_cache, q.dtype)  # int8: dequantized
    v = kv_int8.widen(v_cache.index_select(0, slots), v_cache, q.dtype)
    mask = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta, window: int, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The step's decodes and chunks (`AttentionMetadata` `meta`), each query over the last
    `window` positions up to its own; written into `out` [T, H, D]."""
    for b, length in enumerate(meta.decode_lens.tolist()):
        if length <= 0:  # a padding row
            continue
        pos = torch.tensor([length - 1], device=q.device)
        out[b:b + 1] = _attend(q[b:b + 1], k_cache, v_cache, meta.decode_tables[b],
                               meta.block_size, pos, window, scale)
    starts, prefix = meta.chunk_starts.tolist(), meta.chunk_prefix.tolist()
    for i in range(meta.num_chunks):
        start, end = starts[i], starts[i + 1]
        if end <= start:
            continue
        pos = torch.arange(prefix[i], prefix[i] + end - start, device=q.device)
        out[start:end] = _attend(q[start:end], k_cache, v_cache, meta.chunk_tables[i],
                                 meta.block_size, pos, window, scale)
    return out


def longest_context(meta) -> int:
    """The furthest position + 1 any query of the step reaches (a host read of small tensors;
    asked only by windowed layers)."""
    longest = int(meta.decode_lens.max()) if meta.num_decode else 0
    if meta.num_chunks:
        lens = meta.chunk_starts[1:meta.num_chunks + 1] - meta.chunk_starts[:meta.num_chunks]
        longest = max(longest, int((meta.chunk_prefix[:meta.num_chunks] + lens).max()))
    return longest
