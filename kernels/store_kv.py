"""Write the new tokens' K and V into the paged cache at their slots."""
from __future__ import annotations

import torch


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_slots, num_kv_heads,
    head_dim] (num_slots = num_blocks * block_size); slot_mapping: [num_tokens] int64."""
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
