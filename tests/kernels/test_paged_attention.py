"""Paged decode attention (Triton) against `paged_decode_attention_ref`."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.paged_attention import (
    context_slots,
    paged_decode_attention_ref,
    paged_decode_attention_slots_triton,
    paged_decode_attention_triton,
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
LENGTHS = [1, 15, 16, 17, 300]  # one batch: variable lengths around a page boundary, and long
KV_HEADS = 2


def make_case(head_dim, group, dtype, device, seed=0, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = block_tables_for(lengths, BLOCK, gen)
    k_cache, v_cache = paged_cache(num_blocks, BLOCK, KV_HEADS, head_dim, dtype, device, gen)
    for row, n in zip(tables, lengths, strict=True):
        fill_context(k_cache, row, n, BLOCK, gen)
        fill_context(v_cache, row, n, BLOCK, gen)
    q = torch.randn(len(lengths), KV_HEADS * group, head_dim, generator=gen).to(dtype).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return q, k_cache, v_cache, tables.to(device), lens.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 4], ids=["auto", "split1", "split4"])
def test_block_tables(device, head_dim, group, dtype, num_splits):
    q, k_cache, v_cache, tables, lens = make_case(head_dim, group, dtype, device)
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    scale = head_dim ** -0.5
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    out = poisoned(q.shape, dtype, device)
    got = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, BLOCK, scale,
                                        num_splits=num_splits, out=out)
    assert got is out
    assert_close(got, expected, "attention")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_runtime_slots_form(device, head_dim, group, dtype):
    """The (slots, valid) the runtime passes today, read as a page-size-1 table."""
    q, k_cache, v_cache, tables, lens = make_case(head_dim, group, dtype, device, seed=1)
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    scale = head_dim ** -0.5
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    got = paged_decode_attention_slots_triton(q, k_cache, v_cache, slots, valid, scale,
                                              out=poisoned(q.shape, dtype, device))
    assert_close(got, expected, "attention")


def test_query_heads_strided_in_a_fused_buffer(device):
    """q as the runtime slices it: a view of a fused qkv row with a wider token stride."""
    q, k_cache, v_cache, tables, lens = make_case(64, 3, torch.float32, device, seed=2)
    wide = torch.randn(q.shape[0], q.shape[1] + 4, 64, device=device)
    wide[:, :q.shape[1]] = q
    view = wide[:, :q.shape[1]]
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, 0.125)
    got = paged_decode_attention_triton(view, k_cache, v_cache, tables, lens, BLOCK, 0.125)
    assert_close(got, expected, "attention")


def test_launcher_rejects_bad_inputs(device):
    q, k_cache, v_cache, tables, lens = make_case(64, 1, torch.float32, device,
                                                  lengths=[3, 5])
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention_triton(q[:, :1].expand(2, 3, 64), k_cache, v_cache, tables,
                                      lens, BLOCK, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention_triton(q.bfloat16(), k_cache, v_cache, tables, lens, BLOCK, 1.0)
    with pytest.raises(ValueError, match="batch"):
        paged_decode_attention_triton(q, k_cache, v_cache, tables[:1], lens, BLOCK, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention_triton(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache,
                                      v_cache, tables, lens, BLOCK, 1.0)


def test_dispatch_takes_block_tables_too():
    """The public op accepts block tables in place of (slots, valid) on every path."""
    q, k_cache, v_cache, tables, lens = make_case(64, 3, torch.float32, "cpu", seed=3)
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    expected = kernels.paged_decode_attention(q, k_cache, v_cache, slots, valid, 0.125)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, None, None, 0.125,
                                         block_tables=tables.long(), context_lens=lens.long(),
                                         block_size=BLOCK)
    assert_close(got, expected, "attention")
