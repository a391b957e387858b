"""Rotary position embedding (the rotate-half layout of Hugging Face Llama checkpoints).

The tables are built once per step at full head width with the sign folded into `sin`, so
applying them is two multiplies, a roll and an add: x * cos + roll(x, D/2) * sin.
Triton kernel: one program per (token, tile of heads) rotates the heads in place, so a strided
view of a fused qkv buffer is rotated where it lies.
"""
from __future__ import annotations

import torch

from kernels._utils import (
    cdiv,
    check,
    check_float,
    check_inner_contiguous,
    kernel,
    next_pow2,
    same_device,
    tl,
)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype, inv_freq: torch.Tensor | None = None,
                   factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [T, 1, D] and signed sin [T, 1, D] (first half negated) for the given positions:
    plain rope of base `theta`, or the given inverse frequencies with both tables scaled by
    `factor` (a scaled rope's, runtime/models/rope.py)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                 device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype)
    sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)
    return cos, sin


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D] from `rotary_cos_sin`. Returns a new tensor."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


@kernel
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_ct,
                   stride_st, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=j_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + j, mask=j_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    mask = (h < num_heads)[:, None] & j_mask[None, :]
    p1 = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    # out = x * cos + roll(x, D/2) * sin: the first half pairs with x2, the second with x1
    tl.store(p1, (x1 * c1[None, :] + x2 * s1[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(x_ptr.dtype.element_ty),
             mask=mask)


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] in place (any token/head strides, contiguous last dim) and
    returns it; cos, sin [T, 1, D] (or [T, D]) from `rotary_cos_sin`."""
    check(x.dim() == 3, lambda: f"x must be [T, heads, D], got {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    check(dim % 2 == 0, lambda: f"head dim {dim} is odd")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape not in ((tokens, 1, dim), (tokens, dim)):
            raise ValueError(f"{name} must be [T, 1, D] or [T, D] for x {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")
        check_float(name, t)
        check_inner_contiguous(name, t)
    check_float("x", x)
    check_inner_contiguous("x", x)
    device = same_device(x, cos, sin)
    if tokens == 0 or heads == 0:
        return x
    half = dim // 2
    block_h = min(next_pow2(heads), max(1, 2048 // next_pow2(half)))
    _rotary_kernel.on(device)[(tokens, cdiv(heads, block_h))](
        x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_H=block_h, num_warps=4)
    return x
