"""The KV cache's rows as the pool holds them, for each `kv_cache_dtype`: how wide a cache
row is and how many bytes a token takes, which the runner's allocation, block shape and
`--kv-cache-gb` accounting read.

A float cache row is the head's values in that type. An int8 cache row is the head's values
in int8 and then their float32 scale (kernels/kv_int8.py), so the tensor is int8 [slots,
heads, values + 4] and a block copied anywhere (disk tier, PD transfer) carries its scales.
"""
from __future__ import annotations

import torch

from contract.config import ModelConfig
from kernels import kv_int8


def element_bytes(kv_dtype: torch.dtype) -> int:
    return torch.empty((), dtype=kv_dtype).element_size()


def cache_row_width(dim: int, kv_dtype: torch.dtype) -> int:
    """The cache tensor's last dimension for rows of `dim` values."""
    return kv_int8.row_width(dim) if kv_dtype == torch.int8 else dim


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """Bytes one token takes in the cache over every layer (K and V, or the shared latent)."""
    row = cache_row_width(cfg.kv_cache_dim, kv_dtype) * element_bytes(kv_dtype)
    return cfg.kv_tensors * cfg.num_hidden_layers * cfg.kv_cache_heads * row


def cache_shape(cfg: ModelConfig, num_slots: int, kv_dtype: torch.dtype) -> tuple[int, ...]:
    """One layer's cache tensor: [slots, cache heads, row width]."""
    return (num_slots, cfg.kv_cache_heads, cache_row_width(cfg.kv_cache_dim, kv_dtype))
