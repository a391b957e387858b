"""Prefill (extend) attention: a chunk of new tokens against its cached prefix and itself.

Triton kernel: one program per (sequence, tile of new tokens, query head) streams the
sequence's K/V out of the paged cache (the new tokens' K/V are stored before attention runs)
with an online softmax, stopping at the tile's last causal position. Sequences of different
prefix and chunk lengths share one launch (`prefill_attention_varlen`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_int8
from kernels._utils import (
    cdiv,
    check,
    check_float,
    check_index,
    check_inner_contiguous,
    kernel,
    next_pow2,
    same_device,
    tl,
)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor, num_prefix: int, scale: float,
                          k_new: torch.Tensor | None = None,
                          v_new: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence. q: [n, H, D] at positions num_prefix .. num_prefix + n - 1.

    slots: [num_prefix + n] flat cache slots of the whole context (the new tokens' K/V are
    already stored). When num_prefix is 0 and k_new/v_new are given, they are used directly
    instead of reading the cache back (rounded to the cache's dtype first, so the result is
    the cache's either way). Causal: position i sees positions <= i.
    """
    n = q.shape[0]
    if num_prefix == 0 and k_new is not None:
        k, v = k_new, v_new
    else:
        k = k_cache.index_select(0, slots)
        v = v_cache.index_select(0, slots)
    # what the cache holds, in q's dtype: a narrower cache's rounding (or an int8 one's
    # quantization) included
    k, v = kv_int8.widen(k, k_cache, q.dtype), kv_int8.widen(v, v_cache, q.dtype)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        ctx = num_prefix + n
        q_pos = torch.arange(num_prefix, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1)


VarlenSeq = tuple[int, int, int, torch.Tensor]  # (first row, end row, num_prefix, slots)


def varlen_slots(block_tables: torch.Tensor, block_size: int, cu_seqlens_q: torch.Tensor,
                 num_prefix: torch.Tensor) -> list[VarlenSeq]:
    """What the reference reads per sequence of a varlen batch: its rows, its cached prefix
    and the flat slots of its whole context. Built once per step, shared by every layer."""
    cu, prefix = cu_seqlens_q.tolist(), num_prefix.tolist()
    seqs = []
    for i in range(block_tables.shape[0]):
        start, end, npre = cu[i], cu[i + 1], prefix[i]
        pos = torch.arange(npre + end - start, device=block_tables.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        seqs.append((start, end, npre, slots))
    return seqs


def prefill_attention_varlen_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, block_size: int,
                                 cu_seqlens_q: torch.Tensor, num_prefix: torch.Tensor,
                                 scale: float, max_q_len: int | None = None, *,
                                 seqs: list[VarlenSeq] | None = None,
                                 k_new: torch.Tensor | None = None,
                                 v_new: torch.Tensor | None = None,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Many sequences (see `prefill_attention_varlen`), one `prefill_attention_ref` each, over
    `seqs` from `varlen_slots` (built here when omitted). k_new/v_new [T, KVH, D]: the rows'
    own K/V, read instead of the cache by a sequence without a prefix. Rows of q outside every
    sequence are left as they are in `out`."""
    if out is None:
        out = torch.empty_like(q)
    if seqs is None:
        seqs = varlen_slots(block_tables, block_size, cu_seqlens_q, num_prefix)
    for start, end, npre, slots in seqs:
        k_rows = k_new[start:end] if k_new is not None else None
        v_rows = v_new[start:end] if v_new is not None else None
        out[start:end] = prefill_attention_ref(q[start:end], k_cache, v_cache, slots, npre, scale,
                                               k_rows, v_rows)
    return out


@kernel
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, cu_q_ptr, prefix_ptr,
                    one_q_len, one_prefix, scale,
                    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_tb,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                    VARLEN: tl.constexpr, DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    if VARLEN:
        q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
        q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
        prefix = tl.load(prefix_ptr + seq).to(tl.int32)
    else:
        q_start = 0
        q_len = one_q_len
        prefix = one_prefix
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = prefix + rows
    # keys up to the tile's last real row; an empty tile (past q_len) loops zero times
    hi = tl.minimum(prefix + (tile + 1) * BLOCK_M, prefix + q_len)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    qk_scale = scale * 1.4426950408889634
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_F32:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        seen = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(seen, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past q_len see nothing
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           table: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check(q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3,
          lambda: f"q must be [T, H, D] and caches [slots, KVH, D]: {tuple(q.shape)}, "
          f"{tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape and k_cache.shape[2] == q.shape[2],
          lambda: f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q "
          f"{tuple(q.shape)}")
    check(q.shape[1] % k_cache.shape[1] == 0, "query heads are not a multiple of KV heads")
    check(q.shape[2] <= 256, lambda: f"head dim {q.shape[2]} > 256 is not supported")
    check_float("q", q)
    check_float("k_cache", k_cache, q.dtype)
    check_float("v_cache", v_cache, q.dtype)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)
    check_index("block table", table, 2)
    check(table.stride(1) == 1, "block table rows must be contiguous")
    same_device(q, k_cache, v_cache, table)
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1,
          "out must match q in shape and dtype, last dim contiguous")
    return out


def _launch(q, k_cache, v_cache, out, table, cu_q, prefix, one_q_len, one_prefix, page,
            scale, num_seqs, max_q_len, varlen):
    heads, dim = q.shape[1], q.shape[2]
    block_m = 64 if dim <= 128 else 32
    block_n = 64 if dim <= 64 else 32
    dot_f32 = q.device.type != "cuda" or q.dtype == torch.float32
    grid = (num_seqs, cdiv(max(max_q_len, 1), block_m), heads)
    _prefill_kernel.on(q.device)[grid](
        q, k_cache, v_cache, out, table, cu_q, prefix, one_q_len, one_prefix, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), table.stride(0),
        GROUP=heads // k_cache.shape[1], HEAD_DIM=dim, BLOCK_D=next_pow2(dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, VARLEN=varlen, DOT_F32=dot_f32,
        num_warps=4, num_stages=2)
    return out


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor, num_prefix: int, scale: float,
                             k_new: torch.Tensor | None = None,
                             v_new: torch.Tensor | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `prefill_attention_ref` (one sequence); K/V always come from the cache,
    so k_new/v_new are accepted and unused."""
    check_index("slots", slots, 1)
    check(slots.shape[0] == num_prefix + q.shape[0],
          lambda: f"slots has {slots.shape[0]} entries, expected num_prefix + n = "
          f"{num_prefix + q.shape[0]}")
    table = slots[None, :]
    out = _check(q, k_cache, v_cache, table, out)
    if q.shape[0] == 0:
        return out
    return _launch(q, k_cache, v_cache, out, table, table, table, q.shape[0], int(num_prefix),
                   1, scale, 1, q.shape[0], False)


def prefill_attention_varlen_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, block_size: int,
                             cu_seqlens_q: torch.Tensor, num_prefix: torch.Tensor,
                             scale: float, max_q_len: int | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Many sequences in one launch. q: [T, H, D], sequence i owning rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] at positions num_prefix[i] + 0, 1, ...;
    block_tables [S, W] page ids covering each sequence's num_prefix + q_len positions.
    `max_q_len` (the longest chunk) sizes the grid; computed (a device sync) when omitted.
    """
    out = _check(q, k_cache, v_cache, block_tables, out)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    check_index("num_prefix", num_prefix, 1)
    num_seqs = block_tables.shape[0]
    check(cu_seqlens_q.shape[0] == num_seqs + 1 and num_prefix.shape[0] == num_seqs,
          lambda: f"{num_seqs} block-table rows need {num_seqs + 1} cu_seqlens_q and {num_seqs} "
          f"num_prefix entries")
    same_device(q, cu_seqlens_q, num_prefix)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    return _launch(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, num_prefix, 0, 0,
                   block_size, scale, num_seqs, max_q_len, True)
