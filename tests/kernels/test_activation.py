"""SiLU-and-multiply (Triton) against `silu_and_mul_ref`."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from tests.kernels.helpers import DTYPES, assert_close, poisoned


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (3, 5, 2 * 100), (1, 2 * 1)], ids=str)
def test_matches_reference(device, shape, dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype, device)
    got = silu_and_mul_triton(gate_up, out=out)
    assert got is out
    assert_close(got, silu_and_mul_ref(gate_up), "elementwise")


def test_rejects_an_odd_width(device):
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul_triton(torch.zeros(2, 7, device=device))
