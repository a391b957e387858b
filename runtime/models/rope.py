"""Rotary frequencies of every scaling kind we serve (contract/rope.py names them).

Each returns the inverse frequencies of the rotated half-dimensions and the factor the cos and
sin tables are multiplied by (YaRN's attention temperature; 1 for the others), computed in
float32 in the order transformers' `modeling_rope_utils` computes them, so a scaled model's
tables are transformers' to the bit (tests/runtime/test_rope_scaling.py).
"""
from __future__ import annotations

import math

import torch

from contract.rope import RopeScaling, yarn_mscale


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] float32 and the tables' scale for `scaling`."""
    inv_freq = _plain(head_dim, theta, device)
    if scaling.frequency_factors:  # a GGUF's rope_freqs, as llama.cpp divides by them
        factors = torch.tensor(scaling.frequency_factors, dtype=torch.float32, device=device)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"{factors.numel()} rope frequency factors for a head of "
                             f"{head_dim} dimensions (needs {inv_freq.numel()})")
        inv_freq = inv_freq / factors
    if scaling.type == "default":
        return inv_freq, 1.0
    if scaling.type == "linear":  # positions divided by the factor, i.e. the frequencies
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.type == "yarn":
        return _yarn(head_dim, theta, scaling, device)
    raise AssertionError(f"RopeScaling refused {scaling.type!r} already")  # pragma: no cover


def _plain(dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64)
                            .to(device=device, dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's: long wavelengths (beyond the original context / low_freq_factor) slowed by
    the factor, short ones (below it / high_freq_factor) kept, a smooth blend between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (slowed by the factor), those turning more than beta_fast times kept, a linear
    ramp between; the tables are scaled by the attention temperature."""
    attention = s.attention_factor
    if attention is None:
        attention = (yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else yarn_mscale(s.factor))
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)
