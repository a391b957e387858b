"""RMSNorm with the fused residual add (Triton) against `rms_norm_ref`."""
from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from tests.kernels.helpers import DTYPES, assert_close, poisoned


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 576), (3, 5, 100), (1, 4096)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(device, shape, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device) if with_residual else None
    x0 = x.clone()
    r0 = residual.clone() if with_residual else None
    out = poisoned(shape, dtype, device)
    if with_residual:
        res_out = poisoned(shape, dtype, device)
        got, got_res = rms_norm_triton(x, weight, 1e-5, residual, out=out, residual_out=res_out)
        expected, expected_res = rms_norm_ref(x, weight, 1e-5, residual)
        assert got is out and got_res is res_out
        assert_close(got_res, expected_res, "elementwise")
        assert torch.equal(residual, r0)
    else:
        got = rms_norm_triton(x, weight, 1e-5, out=out)
        expected = rms_norm_ref(x, weight, 1e-5)
        assert got is out
    assert_close(got, expected, "elementwise")
    assert torch.equal(x, x0)  # inputs are never written


def test_rejects_a_weight_of_the_wrong_width(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.zeros(2, 8, device=device), torch.ones(9, device=device), 1e-5)
