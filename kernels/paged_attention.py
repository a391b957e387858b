"""Decode attention: one query token per sequence against its paged KV context."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def context_slots(block_tables: torch.Tensor, context_lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots of every context position, padded to the longest context.

    Returns (slots [B, L] int64, valid [B, L] bool). Padding points at slot 0 and is masked.
    Computed once per step and shared by all layers.
    """
    max_len = int(context_lens.max()) if context_lens.numel() else 0
    pos = torch.arange(max_len, device=block_tables.device)
    valid = pos[None, :] < context_lens[:, None]
    block_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, block_idx] * block_size + (pos % block_size)[None, :]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, valid: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots, valid: [B, L] from `context_slots`.

    Returns [B, H, D]. Grouped-query heads: query head h reads KV head h // (H // KVH).
    """
    b, l = slots.shape
    k = k_cache.index_select(0, slots.reshape(-1)).view(b, l, *k_cache.shape[1:])
    v = v_cache.index_select(0, slots.reshape(-1)).view(b, l, *v_cache.shape[1:])
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]
