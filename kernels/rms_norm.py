"""RMSNorm, optionally fused with the residual add that precedes it.

Triton kernel: one program per row reads x (and the residual), writes the new residual
x + residual and the normalized row; statistics in float32 whatever the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._utils import (
    check,
    check_float,
    check_inner_contiguous,
    kernel,
    next_pow2,
    same_device,
    tl,
)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Returns norm(x + residual) and, when a residual is given, the new residual x + residual.

    Statistics are taken in float32 whatever the input dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        out = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight
    return out if residual is None else (out, residual)


@kernel
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * rstd
    if ROUND_BEFORE_WEIGHT:  # the reference's order for half types: round, then scale
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None):
    """Same contract as `rms_norm_ref`; x [..., N] with a contiguous last dimension. `out` and
    `residual_out` may be given (same shape and dtype as x); the inputs are never written."""
    check_float("x", x)
    check_float("weight", weight)
    check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
          lambda: f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    check_inner_contiguous("weight", weight)
    n = x.shape[-1]
    check(n <= 65536, lambda: f"rows of {n} elements are too long for one program")
    x2 = x.reshape(-1, n)
    check_inner_contiguous("x", x2)
    tensors = [x, weight]
    r2 = ro2 = None
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              "residual must match x in shape and dtype")
        r2 = residual.reshape(-1, n)
        check_inner_contiguous("residual", r2)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        ro2 = residual_out.view(-1, n)
        tensors.append(residual)
    if out is None:
        out = torch.empty_like(x)
    check(out.shape == x.shape and out.dtype == x.dtype, "out must match x in shape and dtype")
    o2 = out.view(-1, n)
    device = same_device(*tensors, out)
    rows = x2.shape[0]
    if rows:
        block = next_pow2(n)
        _rms_norm_kernel.on(device)[(rows,)](
            x2, r2 if r2 is not None else x2, weight, o2, ro2 if ro2 is not None else o2,
            n, float(eps), x2.stride(0), r2.stride(0) if r2 is not None else 0, o2.stride(0),
            ro2.stride(0) if ro2 is not None else 0,
            HAS_RESIDUAL=residual is not None, ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual_out)
