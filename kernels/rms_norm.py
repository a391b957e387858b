"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Returns norm(x + residual) and, when a residual is given, the new residual x + residual."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)
