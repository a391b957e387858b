"""Store of new K/V into the paged cache (Triton) against `store_kv_ref`."""
from __future__ import annotations

import pytest
import torch

from kernels.store_kv import store_kv_ref, store_kv_triton
from tests.kernels.helpers import DTYPES, TOLERANCE

KV_HEADS = 3


def fused_kv(tokens, head_dim, dtype, device, gen):
    """key and value as the runtime has them: strided views of one fused qkv buffer."""
    qkv = torch.randn(tokens, 9 + 2 * KV_HEADS, head_dim, generator=gen).to(dtype).to(device)
    return qkv[:, 9:9 + KV_HEADS], qkv[:, 9 + KV_HEADS:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_writes_exactly_the_mapped_slots(device, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    num_slots, tokens = 16 * 7, 17
    key, value = fused_kv(tokens, head_dim, dtype, device, gen)
    slots = (torch.randperm(num_slots, generator=gen)[:tokens]).to(device)
    caches = [torch.full((num_slots, KV_HEADS, head_dim), float("nan"), dtype=dtype,
                         device=device) for _ in range(4)]
    store_kv_ref(key, value, caches[0], caches[1], slots)
    store_kv_triton(key, value, caches[2], caches[3], slots)
    for got, expected in ((caches[2], caches[0]), (caches[3], caches[1])):
        # a copy is exact; NaN == NaN where nothing was written
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)
    written = torch.zeros(num_slots, dtype=torch.bool, device=device)
    written[slots] = True
    assert not caches[2][written].isnan().any() and caches[2][~written].isnan().all()


def test_casts_to_the_cache_dtype_and_skips_negative_slots(device):
    gen = torch.Generator().manual_seed(1)
    key, value = fused_kv(5, 64, torch.float32, device, gen)
    slots = torch.tensor([3, -1, 0, 40, -1], device=device)
    k_cache = torch.full((48, KV_HEADS, 64), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = k_cache.clone()
    store_kv_triton(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    ref_k, ref_v = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    store_kv_ref(key[keep], value[keep], ref_k, ref_v, slots[keep])
    # one bfloat16 rounding apart: Triton's interpreter truncates where torch rounds to nearest
    atol, rtol = TOLERANCE["elementwise"][torch.bfloat16]
    for got, expected in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=True)


def test_rejects_mismatched_shapes(device):
    key = torch.zeros(4, KV_HEADS, 64, device=device)
    cache = torch.zeros(32, KV_HEADS, 128, device=device)
    with pytest.raises(ValueError, match="do not fit"):
        store_kv_triton(key, key, cache, cache, torch.arange(4, device=device))
    cache = torch.zeros(32, KV_HEADS, 64, device=device)
    with pytest.raises(ValueError, match="slots for"):
        store_kv_triton(key, key, cache, cache, torch.arange(3, device=device))
