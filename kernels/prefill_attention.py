"""Prefill (extend) attention: a chunk of new tokens against its cached prefix and itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor, num_prefix: int, scale: float,
                          k_new: torch.Tensor | None = None,
                          v_new: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence. q: [n, H, D] at positions num_prefix .. num_prefix + n - 1.

    slots: [num_prefix + n] flat cache slots of the whole context (the new tokens' K/V are
    already stored). When num_prefix is 0 and k_new/v_new are given, they are used directly
    instead of reading the cache back. Causal: position i sees positions <= i.
    """
    n = q.shape[0]
    if num_prefix == 0 and k_new is not None:
        k, v = k_new, v_new
    else:
        k = k_cache.index_select(0, slots)
        v = v_cache.index_select(0, slots)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        ctx = num_prefix + n
        q_pos = torch.arange(num_prefix, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1)
