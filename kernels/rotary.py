"""Rotary position embedding (the rotate-half layout of Hugging Face Llama checkpoints).

The tables are built once per step at full head width with the sign folded into `sin`, so
applying them is two multiplies, a roll and an add: x * cos + roll(x, D/2) * sin.
"""
from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [T, 1, D] and signed sin [T, 1, D] (first half negated) for the given positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype)
    sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)
    return cos, sin


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D] from `rotary_cos_sin`. Returns a new tensor."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
