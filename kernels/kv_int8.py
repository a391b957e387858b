"""The 8-bit KV cache's rows in torch: written and read by the reference paths, and the
layout the C kernels (kernels/cpu/simd.h, attention.c) read directly.

A cache of `kv_cache_dtype` int8 is an int8 tensor [slots, KVH, D + SCALE_BYTES]: each row
(one token, one KV head) is D int8 values q and then its float32 scale d = absmax / 127 as 4
bytes, value i = q[i] * d. Keeping the scale inside the row means every copy of a block (the
prefix cache's disk tier, PD transfers, the runner's block reads and writes) carries its scales
without knowing about them. One scale a row rather than one a block of 32 values (GGUF's
Q8_0): the C attention applies a row's scale once, to that key's score or that value's
softmax weight, so its inner loops stay the float16 cache's with a byte load in place of a
half-float one; a scale per 32 values would cost a multiply per block per row. A row is
64 + 4 bytes at head dim 64 against 128 in float16: 1.88x the tokens in the same memory.

Quantization rounds x * (127 / absmax) half to even, in float32, exactly as the C store does
(`put_i8`), so both write the same bytes; the error of a value is at most d / 2 = absmax / 254.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after each row's values
LEVELS = 127.0  # |q| <= 127: symmetric, -128 unused


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(dim: int) -> int:
    """The int8 cache's last dimension for rows of `dim` values."""
    return dim + SCALE_BYTES


def values_of(cache: torch.Tensor) -> int:
    """How many values a row of this cache holds (its last dimension, less an int8 row's
    scale)."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def check_width(cache: torch.Tensor, dim: int) -> None:
    """Refuse an int8 cache whose rows do not hold `dim` values and a scale (one allocated with
    a float cache's shape would be read past its rows)."""
    if is_int8(cache) and cache.shape[-1] != row_width(dim):
        raise ValueError(f"an int8 KV cache for head dim {dim} has rows of {row_width(dim)} "
                         f"bytes ({dim} values and a float32 scale), not {cache.shape[-1]}")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as int8 rows [..., D + SCALE_BYTES] with their scales."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, LEVELS / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).to(torch.int8)
    scale = (amax / LEVELS).contiguous().view(torch.int8)  # [..., 1] float32 as its 4 bytes
    return torch.cat([q, scale], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + SCALE_BYTES] as values [..., D] of `dtype` (float32 products)."""
    q = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (q * scale).to(dtype)


def widen(rows: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What `cache` holds for `rows` in `dtype`: rows read from the cache (int8: dequantized),
    or new float rows rounded as the cache stores them (int8: quantized, then dequantized)."""
    if not is_int8(cache):
        return rows.to(cache.dtype).to(dtype)
    return dequantize_rows(rows if rows.dtype == torch.int8 else quantize_rows(rows), dtype)
