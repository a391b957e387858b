"""SiLU-and-multiply: the gate of a SwiGLU MLP.

Triton kernel: one program per (row, tile of columns) computes silu(gate) * up in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * d] holding gate then up; returns silu(gate) * up of shape [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@kernel
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `silu_and_mul_ref`; rows of gate_up need a contiguous last dim."""
    check_float("gate_up", gate_up)
    check(gate_up.shape[-1] % 2 == 0, lambda: f"last dim {gate_up.shape[-1]} is odd")
    d = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * d)
    check_inner_contiguous("gate_up", x2)
    if out is None:
        out = torch.empty(*gate_up.shape[:-1], d, device=gate_up.device, dtype=gate_up.dtype)
    check(out.shape == (*gate_up.shape[:-1], d) and out.dtype == gate_up.dtype,
          "out must be [..., d] in the dtype of gate_up")
    o2 = out.view(-1, d)
    device = same_device(gate_up, out)
    rows = x2.shape[0]
    if rows and d:
        block = min(1024, next_pow2(d))
        _silu_and_mul_kernel.on(device)[(rows, cdiv(d, block))](
            x2, o2, d, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4)
    return out
