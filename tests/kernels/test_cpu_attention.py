"""The CPU form of paged decode attention against `paged_decode_attention_ref`, on caches
whose unused slots are NaN (so a padded position that leaks into a sum fails)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.cpu_attention import paged_decode_attention_cpu
from kernels.paged_attention import context_slots, paged_decode_attention_ref
from tests.kernels.helpers import DTYPES, assert_close
from tests.kernels.test_paged_attention import BLOCK, make_case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(head_dim, group, dtype):
    q, k_cache, v_cache, tables, lens = make_case(head_dim, group, dtype, "cpu")
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    scale = head_dim ** -0.5
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables.long(), lens.long(), BLOCK,
                                     scale)
    assert_close(got, expected, "attention")


def test_strided_query_and_a_single_token_context():
    """q as the runtime slices it (a view of a wider buffer), and contexts of 1 token."""
    q, k_cache, v_cache, tables, lens = make_case(64, 3, torch.float32, "cpu", seed=4,
                                                  lengths=[1, 1, 33])
    wide = torch.randn(q.shape[0], q.shape[1] + 5, 64)
    wide[:, :q.shape[1]] = q
    view = wide[:, :q.shape[1]]
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, 0.125)
    got = paged_decode_attention_cpu(view, k_cache, v_cache, tables.long(), lens.long(),
                                     BLOCK, 0.125)
    assert_close(got, expected, "attention")


def test_dispatch_uses_it_for_cpu_tensors_with_block_tables():
    q, k_cache, v_cache, tables, lens = make_case(64, 3, torch.float32, "cpu", seed=5)
    direct = paged_decode_attention_cpu(q, k_cache, v_cache, tables.long(), lens.long(),
                                        BLOCK, 0.125)
    if kernels.use_triton(q) or kernels.FORCE_REFERENCE:
        pytest.skip("this process routes CPU tensors elsewhere (INFERSTACK_KERNELS)")
    got = kernels.paged_decode_attention(q, k_cache, v_cache, None, None, 0.125,
                                         block_tables=tables.long(), context_lens=lens.long(),
                                         block_size=BLOCK)
    assert torch.equal(got, direct)
