"""Tolerances from a dtype's resolution and the arithmetic's order, not from one machine.

Two computations of the same value in a different order (a batch padded to a bucket, another
SIMD width, another GEMM blocking) agree in float32 to a few units in the last place; stored
in a narrower type, that difference can flip the rounding by one unit of the narrow type. So a
comparison of stored values allows one unit of the stored type's resolution (relative: the
type's epsilon), plus the float32 noise floor for values near zero, where the narrow type's
units are smaller than float32's arithmetic error on the terms that summed to them.
"""
from __future__ import annotations

import torch

FLOAT32_ORDER_ATOL = 1e-5  # float32 results of reordered sums of O(1) terms


def stored_in(dtype: torch.dtype, units: int = 1) -> dict[str, float]:
    """`assert_close` keywords for values stored in `dtype` after float32 arithmetic done in
    another order: `units` roundings of the stored type may differ."""
    return {"rtol": units * torch.finfo(dtype).eps, "atol": FLOAT32_ORDER_ATOL}


def read_from(dtype: torch.dtype, scale: float, units: int = 1) -> dict[str, float]:
    """`assert_close` keywords for float32 results computed from values stored in `dtype` that
    may themselves differ by `units` units between the two runs (`stored_in`: a KV cache
    written by a reordered product, then read by attention). A result moves by up to that
    relative amount of the values it mixes, not of itself: near a zero of the result the
    difference is absolute, `units` epsilons of `scale`, the results' magnitude (their root
    mean square). A float32 `dtype` keeps the float32 reordering floor."""
    eps = units * torch.finfo(dtype).eps
    return {"rtol": eps, "atol": max(eps * scale, FLOAT32_ORDER_ATOL)}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference relative to the reference's largest magnitude: how far
    logits moved, on the scale the sampler compares them at."""
    return float((ours - ref).abs().max() / ref.abs().max())
