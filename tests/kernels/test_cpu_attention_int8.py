"""The 8-bit KV cache in the C kernels (kernels/cpu/attention.c, simd.h) against the torch
references that dequantize the same int8 rows (kernels/kv_int8.py): the C store writes the
bytes the reference's quantization writes, decodes and prefill chunks (with and without a
sliding window) read the rows and their scales in place, never a row outside a context (those
rows' scales are NaN here), in the AVX-512 build and the AVX2 one.

Tolerance: the reference dequantizes each value as one float32 product q * d and attends in
float32; the kernel sums q . k_int8 and applies d once a row. Both are exact to float32
rounding of the same numbers, so only the summation order differs, as for a float32 cache:
the float32 attention tolerance (tests/kernels/helpers.py) holds.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import cpu_build, cpu_ops, kv_int8
from kernels.paged_attention import context_slots, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_varlen_ref
from kernels.store_kv import store_kv_ref
from tests.kernels.helpers import assert_close, block_tables_for, fill_context, paged_cache

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")

PAGE = 16
SEQS = [(0, 1), (15, 16), (16, 1), (0, 17), (17, 33), (250, 70)]


def int8_caches(totals, tables, num_blocks, kv_heads, head_dim, gen):
    """int8 K and V caches holding random rows at every position of each sequence; every
    other row (past a context, unused pages) quantized from NaN: its scale is NaN, so a read
    of it shows in the output. Block 0 is finite (the references read it for padding)."""
    caches = []
    for _ in range(2):
        floats = paged_cache(num_blocks, PAGE, kv_heads, head_dim, torch.float32, "cpu", gen)[0]
        for row, n in zip(tables, totals, strict=True):
            fill_context(floats, row, n, PAGE, gen)
        caches.append(kv_int8.quantize_rows(floats))
    return caches[0], caches[1]


def chunks_case(seqs, kv_heads, group, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in seqs]
    tables, num_blocks = block_tables_for(totals, PAGE, gen)
    kc, vc = int8_caches(totals, tables, num_blocks, kv_heads, head_dim, gen)
    lens = [n for _, n in seqs]
    q = torch.randn(sum(lens), kv_heads * group, head_dim, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return q, kc, vc, tables.long(), cu, torch.tensor([p for p, _ in seqs])


def test_the_c_store_writes_the_references_bytes():
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(7, 3, 40, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]
    key[2, 1] = 0.0  # an all-zero row: scale 0, values 0
    value = torch.randn(7, 3, 40, generator=gen)
    slots = torch.tensor([5, 0, 9, -1, 3, 12, 7])  # a negative slot is skipped
    caches = [torch.zeros(16, 3, kv_int8.row_width(40), dtype=torch.int8) for _ in range(4)]
    cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    keep = slots >= 0
    store_kv_ref(key[keep], value[keep], caches[2], caches[3], slots[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not caches[0][9, 1].any()  # the zero row


def test_quantization_error_is_half_a_step():
    """Each value is within d / 2 = absmax / 254 of the original (plus float32 rounding)."""
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(1)) * 3
    back = kv_int8.dequantize_rows(kv_int8.quantize_rows(x))
    bound = x.abs().amax(-1, keepdim=True) / 254 * (1 + 2 ** -20)
    assert ((back - x).abs() <= bound).all()
    assert kv_int8.quantize_rows(x)[..., :-4].abs().max() == 127


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_prefill_chunks_match_the_dequantizing_reference(group, head_dim):
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, group, head_dim, seed=group)
    scale = head_dim ** -0.5
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, PAGE, cu, prefix, scale)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, scale)
    assert_close(got, expected, "attention")


@pytest.mark.parametrize("batch", [1, 3, 8])  # single KV heads a task below 2 x threads
@pytest.mark.parametrize("head_dim", [64, 40])
def test_decodes_match_the_dequantizing_reference(batch, head_dim):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.tensor([1, 16, 17, 100, 333, 5, 64, 31][:batch])
    tables, num_blocks = block_tables_for(lens.tolist(), PAGE, gen)
    kc, vc = int8_caches(lens.tolist(), tables, num_blocks, 3, head_dim, gen)
    q = torch.randn(batch, 9, head_dim, generator=gen)
    slots, valid = context_slots(tables.long(), lens, PAGE)
    expected = paged_decode_attention_ref(q, kc, vc, slots, valid, head_dim ** -0.5)
    got = kernels.paged_decode_attention(q, kc, vc, None, None, head_dim ** -0.5,
                                         block_tables=tables.long(), context_lens=lens,
                                         block_size=PAGE)
    assert_close(got, expected, "attention")


@pytest.mark.parametrize("window", [1, 16, 40])
def test_sliding_windows_match_the_reference(window):
    from tests.kernels.test_cpu_attention import windowed_reference
    seqs = [(0, 37), (15, 16), (250, 70), (100, 1)]
    q, kc, vc, tables, cu, prefix = chunks_case(seqs, 2, 3, 64, seed=window)
    wide_k, wide_v = kv_int8.dequantize_rows(kc), kv_int8.dequantize_rows(vc)
    expected = windowed_reference(q, wide_k, wide_v, tables, cu, prefix, 0.125, window)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, 0.125, window=window)
    assert_close(got, expected, "attention")


def test_a_cache_without_room_for_the_scales_is_refused():
    q = torch.randn(1, 3, 64)
    cache = torch.zeros(32, 3, 64, dtype=torch.int8)  # a float cache's shape
    with pytest.raises(ValueError, match="rows of 68 bytes"):
        cpu_ops.decode_attention(q, cache, cache, torch.zeros(1, 2, dtype=torch.long),
                                 torch.tensor([1]), PAGE, 0.125)


AVX2_CHECK = """
import torch
from kernels import cpu_build, cpu_ops, kv_int8
from kernels.prefill_attention import prefill_attention_varlen_ref
from kernels.store_kv import store_kv_ref
from tests.kernels.test_cpu_attention_int8 import SEQS, chunks_case
assert cpu_build.isa() == "avx2" and cpu_ops.available(), cpu_build.unavailable_reason()
for head_dim in (64, 40):
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, 3, head_dim)
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, 16, cu, prefix, 0.125)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, 16, cu, prefix, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
key = torch.randn(5, 2, 40) * 10
caches = [torch.zeros(8, 2, 44, dtype=torch.int8) for _ in range(4)]
cpu_ops.store_kv(key, key, caches[0], caches[1], torch.arange(5))
store_kv_ref(key, key, caches[2], caches[3], torch.arange(5))
assert torch.equal(caches[0], caches[2])
print("ok")
"""


@pytest.mark.skipif(cpu_build.isa() != "avx512", reason="this CPU builds only the AVX2 kernel")
def test_the_avx2_build_computes_the_same(tmp_path):
    env = dict(os.environ, INFERSTACK_CPU_ISA="avx2", XDG_CACHE_HOME=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
