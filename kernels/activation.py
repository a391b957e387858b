"""SiLU-and-multiply: the gate of a SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * d] holding gate then up; returns silu(gate) * up of shape [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
