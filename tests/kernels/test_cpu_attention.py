"""The C attention over the paged cache (kernels/cpu/attention.c) against the torch
references: prefill and extend chunks of every shape the runtime makes (no prefix, a prefix
ending mid-page, one row, hundreds of rows, several chunks behind decode rows), decodes of
whole sequences and of single KV heads, head sizes the 16-lane scores take and one they do
not, caches of float32, float16 and bfloat16 (the references widen what the cache holds, so
only the summation order differs); never reading a cache slot past a row's own position
(those are NaN here), in the AVX-512 build and the AVX2 one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu_build, cpu_ops
from kernels.paged_attention import context_slots, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_varlen_ref
from tests.kernels.helpers import (
    assert_close,
    block_tables_for,
    fill_context,
    paged_cache,
    poisoned,
)

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")

PAGE = 16
# (cached prefix, new tokens): a whole prompt, a prefix ending mid-page, one new row after a
# full page, an odd-sized prompt, a long extend, one long prompt of many row tiles
SEQS = [(0, 1), (15, 16), (16, 1), (0, 17), (17, 33), (250, 70), (0, 300)]
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def chunks_case(seqs, kv_heads, group, head_dim, lead_rows=0, seed=0,
                cache_dtype=torch.float32):
    """q with `lead_rows` rows before the chunks (where the runtime puts its decodes), the
    caches holding every chunk's whole context, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in seqs]
    tables, num_blocks = block_tables_for(totals, PAGE, gen)
    k_cache, v_cache = paged_cache(num_blocks, PAGE, kv_heads, head_dim, cache_dtype, "cpu",
                                   gen)
    for row, n in zip(tables, totals, strict=True):
        fill_context(k_cache, row, n, PAGE, gen)
        fill_context(v_cache, row, n, PAGE, gen)
    lens = [n for _, n in seqs]
    q = torch.randn(lead_rows + sum(lens), kv_heads * group, head_dim, generator=gen)
    cu = torch.tensor([lead_rows] + (lead_rows + torch.tensor(lens).cumsum(0)).tolist())
    prefix = torch.tensor([p for p, _ in seqs])
    return q, k_cache, v_cache, tables.long(), cu, prefix


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_prefill_chunks_match_the_reference(group, head_dim, cache_dtype):
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, group, head_dim,
                                                cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, PAGE, cu, prefix, scale)
    out = poisoned(q.shape, torch.float32, "cpu")
    got = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, scale, out=out)
    assert got is out
    assert_close(got, expected, "attention")


def test_rows_outside_the_chunks_are_left_alone():
    """The runtime's step: decode rows first, then the chunks; only the chunks' rows are
    written (the decode attention fills the others)."""
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS[:3], 3, 3, 64, lead_rows=5, seed=2)
    out = torch.full_like(q, 7.0)
    cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, 0.125, out=out)
    assert (out[:5] == 7.0).all()
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, PAGE, cu, prefix, 0.125)
    assert_close(out[5:], expected[5:], "attention")


def test_dispatch_sends_float32_chunks_to_the_c_op(monkeypatch):
    import kernels
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS[:2], 2, 3, 64)
    calls = []
    real = cpu_ops.prefill_attention
    monkeypatch.setattr(cpu_ops, "prefill_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    got = kernels.prefill_attention_varlen(q, kc, vc, tables, PAGE, cu, prefix, 0.125)
    assert calls == [1]
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, PAGE, cu, prefix, 0.125)
    assert_close(got, expected, "attention")


@pytest.mark.parametrize("batch", [1, 3, 8])  # single KV heads a task below 2 x threads
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decodes_match_the_reference(batch, head_dim, cache_dtype):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.tensor([1, 16, 17, 100, 333, 5, 64, 31][:batch])
    tables, num_blocks = block_tables_for(lens.tolist(), PAGE, gen)
    kc, vc = paged_cache(num_blocks, PAGE, 3, head_dim, cache_dtype, "cpu", gen)
    for row, n in zip(tables, lens.tolist(), strict=True):
        fill_context(kc, row, n, PAGE, gen)
        fill_context(vc, row, n, PAGE, gen)
    q = torch.randn(batch, 9, head_dim, generator=gen)
    slots, valid = context_slots(tables.long(), lens, PAGE)
    expected = paged_decode_attention_ref(q, kc, vc, slots, valid, head_dim ** -0.5)
    got = cpu_ops.decode_attention(q, kc, vc, tables.long(), lens, PAGE, head_dim ** -0.5)
    assert_close(got, expected, "attention")


AVX2_CHECK = """
import torch
from kernels import cpu_build, cpu_ops
from kernels.prefill_attention import prefill_attention_varlen_ref
from tests.kernels.test_cpu_attention import SEQS, chunks_case
assert cpu_build.isa() == "avx2" and cpu_ops.available(), cpu_build.unavailable_reason()
for head_dim, dtype in ((64, torch.float32), (40, torch.float32), (64, torch.float16),
                       (40, torch.bfloat16)):
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, 3, head_dim, cache_dtype=dtype)
    expected = prefill_attention_varlen_ref(q, kc, vc, tables, 16, cu, prefix, 0.125)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, 16, cu, prefix, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
from tests.kernels.test_cpu_attention import windowed_reference
q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, 3, 40)
expected = windowed_reference(q, kc, vc, tables, cu, prefix, 0.125, 24)
got = cpu_ops.prefill_attention(q, kc, vc, tables, 16, cu, prefix, 0.125, window=24)
torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
print("ok")
"""


@pytest.mark.skipif(cpu_build.isa() != "avx512", reason="this CPU builds only the AVX2 kernel")
def test_the_avx2_build_computes_the_same(tmp_path):
    env = dict(os.environ, INFERSTACK_CPU_ISA="avx2", XDG_CACHE_HOME=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def windowed_reference(q, k_cache, v_cache, tables, cu, prefix, scale, window):
    """Each chunk row at position p against positions p - window + 1 .. p, one masked SDPA a
    chunk over the gathered context (the float32 reference; the cache widened)."""
    out = torch.zeros_like(q)
    for i in range(len(prefix)):
        start, end, first = int(cu[i]), int(cu[i + 1]), int(prefix[i])
        positions = torch.arange(first, first + end - start)
        keys = torch.arange(0, first + end - start)
        slots = tables[i][keys // PAGE] * PAGE + keys % PAGE
        mask = (keys[None] <= positions[:, None]) & (keys[None] > positions[:, None] - window)
        k = torch.nan_to_num(k_cache[slots].float()).transpose(0, 1)  # unread: NaN -> 0
        v = torch.nan_to_num(v_cache[slots].float()).transpose(0, 1)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
            scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def _poison_before(cache, table, upto: int):
    """NaN in a sequence's positions 0..upto - 1: outside every window of its rows."""
    for p in range(upto):
        cache[int(table[p // PAGE]) * PAGE + p % PAGE] = float("nan")


@pytest.mark.parametrize("window", [1, 5, 16, 40, 100])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_sliding_windows_match_the_reference(window, cache_dtype):
    """Prefill chunks and decodes with a sliding window: each row sees only its last `window`
    positions, whatever the chunk and page alignment, and positions outside every row's
    window are never read (NaN there)."""
    seqs = [(0, 37), (15, 16), (250, 70), (100, 1)]
    q, kc, vc, tables, cu, prefix = chunks_case(seqs, 2, 3, 64, seed=window,
                                                cache_dtype=cache_dtype)
    for row, (first, _) in zip(tables, seqs, strict=True):
        _poison_before(kc, row, max(first - window + 1, 0))
        _poison_before(vc, row, max(first - window + 1, 0))
    expected = windowed_reference(q, kc, vc, tables, cu, prefix, 0.125, window)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, 0.125, window=window)
    assert_close(got, expected, "attention")
    # the last row of each chunk as a decode: one query at its sequence's last position
    last = cu[1:] - 1
    lens = prefix + (cu[1:] - cu[:-1])
    got = cpu_ops.decode_attention(q[last].contiguous(), kc, vc, tables, lens, PAGE, 0.125,
                                   window=window)
    assert_close(got, expected[last], "attention")


def test_a_window_longer_than_every_context_is_plain_causal():
    q, kc, vc, tables, cu, prefix = chunks_case(SEQS, 2, 3, 64, seed=5)
    plain = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, 0.125)
    windowed = cpu_ops.prefill_attention(q, kc, vc, tables, PAGE, cu, prefix, 0.125,
                                         window=10_000)
    assert torch.equal(plain, windowed)
