"""Prefill/extend attention (Triton) against `prefill_attention_ref`."""
from __future__ import annotations

import pytest
import torch

from kernels.prefill_attention import (
    prefill_attention_ref,
    prefill_attention_triton,
    prefill_attention_varlen_ref,
    prefill_attention_varlen_triton,
    varlen_slots,
)
from tests.kernels.helpers import (
    DTYPES,
    assert_close,
    block_tables_for,
    fill_context,
    paged_cache,
    poisoned,
)

BLOCK = 16
KV_HEADS = 2
# (cached prefix, new tokens): whole contexts of 1, 15+16, 16+1, 17, 17+33 and a few hundred
SEQS = [(0, 1), (15, 16), (16, 1), (0, 17), (17, 33), (250, 70)]


def make_case(head_dim, group, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in SEQS]
    tables, num_blocks = block_tables_for(totals, BLOCK, gen)
    k_cache, v_cache = paged_cache(num_blocks, BLOCK, KV_HEADS, head_dim, dtype, device, gen)
    for row, n in zip(tables, totals, strict=True):
        fill_context(k_cache, row, n, BLOCK, gen)
        fill_context(v_cache, row, n, BLOCK, gen)
    q_lens = [n for _, n in SEQS]
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    prefix = torch.tensor([p for p, _ in SEQS], dtype=torch.int32)
    return (q.to(device), k_cache, v_cache, tables.to(device), cu.to(device),
            prefix.to(device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_batch(device, head_dim, group, dtype):
    q, k_cache, v_cache, tables, cu, prefix = make_case(head_dim, group, dtype, device)
    scale = head_dim ** -0.5
    expected = prefill_attention_varlen_ref(q, k_cache, v_cache, tables, BLOCK, cu, prefix,
                                            scale)
    out = poisoned(q.shape, dtype, device)
    got = prefill_attention_varlen_triton(q, k_cache, v_cache, tables, BLOCK, cu, prefix, scale,
                                          max_q_len=max(n for _, n in SEQS), out=out)
    assert got is out
    assert_close(got, expected, "attention")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 8])
def test_one_sequence_as_the_runtime_calls_it(device, group, dtype):
    """The per-sequence form: flat slots of the whole context, k_new/v_new given."""
    head_dim = 64
    q, k_cache, v_cache, tables, cu, _ = make_case(head_dim, group, dtype, device, seed=1)
    scale = head_dim ** -0.5
    for i in (1, 3, 5):  # prefix 15, no prefix, prefix 250
        npre, n = SEQS[i]
        pos = torch.arange(npre + n, device=device)
        slots = tables[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        rows = slice(int(cu[i]), int(cu[i + 1]))
        k_new, v_new = k_cache[slots[npre:]], v_cache[slots[npre:]]
        expected = prefill_attention_ref(q[rows], k_cache, v_cache, slots, npre, scale,
                                         k_new, v_new)
        got = prefill_attention_triton(q[rows], k_cache, v_cache, slots, npre, scale,
                                       k_new, v_new, out=poisoned((n, *q.shape[1:]), dtype,
                                                                  device))
        assert_close(got, expected, "attention")


def test_rejects_slots_of_the_wrong_length(device):
    q, k_cache, v_cache, *_ = make_case(64, 1, torch.float32, device)
    with pytest.raises(ValueError, match="num_prefix"):
        prefill_attention_triton(q[:4], k_cache, v_cache, torch.arange(5, device=device), 0, 1.0)


def test_varlen_reference_over_a_plan_reads_new_rows_without_a_prefix():
    """The CPU path: per-sequence slots built once (`varlen_slots`), and a sequence with no
    prefix attending over its rows' own K/V rather than reading the cache back."""
    q, k_cache, v_cache, tables, cu, prefix = make_case(64, 3, torch.float32, "cpu", seed=2)
    seqs = varlen_slots(tables, BLOCK, cu, prefix)
    k_new = torch.full((q.shape[0], KV_HEADS, 64), float("nan"))
    v_new = k_new.clone()
    for start, end, npre, slots in seqs:  # the rows' K/V, as the cache holds them
        k_new[start:end] = k_cache[slots[npre:]]
        v_new[start:end] = v_cache[slots[npre:]]
    expected = prefill_attention_varlen_ref(q, k_cache, v_cache, tables, BLOCK, cu, prefix,
                                            0.125)
    out = poisoned(q.shape, torch.float32, "cpu")
    got = prefill_attention_varlen_ref(q, k_cache, v_cache, tables, BLOCK, cu, prefix, 0.125,
                                       seqs=seqs, k_new=k_new, v_new=v_new, out=out)
    assert got is out
    assert_close(got, expected, "attention")
