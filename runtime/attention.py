"""Per-step attention metadata and the paged attention layer that reads it.

The runner lays the step's tokens out as [decode tokens (one per request) | prefill chunks],
builds this metadata once, and every layer reuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass
class PrefillSeq:
    q_start: int  # offset of this chunk in the step's token list
    q_len: int
    num_prefix: int  # tokens of this request already in the cache
    slots: torch.Tensor  # [num_prefix + q_len] flat cache slots of the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored
    cos: torch.Tensor  # [T, 1, head_dim] (see kernels.rotary_cos_sin)
    sin: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, L]
    decode_valid: torch.Tensor | None  # [num_decode, L]
    prefills: list[PrefillSeq]


class PagedAttention:
    """Stores new K/V in the layer's cache, then attends decodes and prefill chunks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        # decode
        if nd:
            out[:nd] = kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_slots,
                                                      meta.decode_valid, self.scale)
        # prefill
        for p in meta.prefills:
            end = p.q_start + p.q_len
            out[p.q_start:end] = kernels.prefill_attention(
                q[p.q_start:end], k_cache, v_cache, p.slots, p.num_prefix, self.scale,
                k_new=k[p.q_start:end], v_new=v[p.q_start:end])
        return out
