"""Rotary embedding applied in place (Triton) against `apply_rotary_ref`."""
from __future__ import annotations

import pytest
import torch

from kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin
from tests.kernels.helpers import DTYPES, assert_close

Q_HEADS, KV_HEADS = 9, 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_in_place_on_the_query_and_key_heads_of_a_fused_buffer(device, head_dim, dtype):
    """As the runtime calls it: q and k heads of a fused qkv row, rotated where they lie; the
    v heads beside them (poisoned with NaN) must stay untouched."""
    gen = torch.Generator().manual_seed(0)
    tokens = 17
    positions = torch.tensor([0, 1, 15, 16, 17] + torch.randint(0, 8192, (tokens - 5,),
                                                                  generator=gen).tolist())
    cos, sin = rotary_cos_sin(positions.to(device), head_dim, 100000.0, dtype)
    qkv = torch.randn(tokens, Q_HEADS + 2 * KV_HEADS, head_dim, generator=gen).to(dtype)
    qkv[:, Q_HEADS + KV_HEADS:] = float("nan")
    qkv = qkv.to(device)
    x = qkv[:, :Q_HEADS + KV_HEADS]
    expected = apply_rotary_ref(x.clone(), cos, sin)
    got = apply_rotary_triton(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()
    assert_close(got, expected, "elementwise")
    assert qkv[:, Q_HEADS + KV_HEADS:].isnan().all()


def test_rejects_tables_of_the_wrong_length(device):
    x = torch.zeros(4, 2, 64, device=device)
    cos, sin = rotary_cos_sin(torch.arange(3, device=device), 64, 10000.0, torch.float32)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_triton(x, cos, sin)
