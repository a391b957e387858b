"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
