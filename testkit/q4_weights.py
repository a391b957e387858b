"""Weights in the form a GGUF Q4_1 file holds them, for tests of the 4-bit path.

Here with the other shared helpers so the kernel and runtime tests (and any benchmark of the
4-bit path) draw the same matrices.
"""
from __future__ import annotations

import torch


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] as llama.cpp's Q4_1 quantizer leaves a matrix: per 32 inputs, q * d + m with q in
    0..15 (both ends used: the block's min and max) and float16 d and m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.randn(n, k // 32, 1, generator=g) * 0.05).half().float()
    return (q * d + m).view(n, k)


def snapped_to_q4_1(w: torch.Tensor) -> torch.Tensor:
    """A float matrix rounded to the nearest Q4_1 matrix (what a GGUF conversion does), so a
    tiny random model can stand in for a 4-bit file."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = ((g - m) / torch.where(d > 0, d, 1.0)).round().clamp(0, 15)
    return (q * d + m).view(n, k)
