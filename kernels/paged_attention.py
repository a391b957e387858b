"""Decode attention: one query token per sequence against its paged KV context.

Triton kernel (split-K "flash decoding"): one program per (sequence, KV head, context split)
handles all query heads of its group, so each K/V row is read once per group; a second kernel
merges the splits by their log-sum-exp. Pages come from a block table of any page size (the
runtime passes its block tables and context lengths); a [B, L] `slots` matrix, what the
reference reads, is the same table with page size 1.
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
    sm_count,
    tl,
)

MAX_SPLITS = 32


def context_slots(block_tables: torch.Tensor, context_lens: torch.Tensor,
                  block_size: int, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots of every context position, padded to the longest context.

    Returns (slots [B, L] int64, valid [B, L] bool), L = `max_len` (the longest context;
    read from the lengths when omitted, a device sync on CUDA). Padding points at slot 0 and
    is masked. Computed once per step and shared by all layers.
    """
    if max_len is None:
        max_len = int(context_lens.max()) if context_lens.numel() else 0
    pos = torch.arange(max_len, device=block_tables.device)
    valid = pos[None, :] < context_lens[:, None]
    block_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, block_idx] * block_size + (pos % block_size)[None, :]
    return torch.where(valid, slots, 0), valid


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, valid: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots, valid: [B, L] from `context_slots`.

    Returns [B, H, D]. Grouped-query heads: query head h reads KV head h // (H // KVH).
    """
    b, n_ctx = slots.shape
    k = k_cache.index_select(0, slots.reshape(-1)).view(b, n_ctx, *k_cache.shape[1:])
    v = v_cache.index_select(0, slots.reshape(-1)).view(b, n_ctx, *v_cache.shape[1:])
    # a narrower cache (float16 under float32) widened, an int8 one dequantized
    k, v = kv_int8.widen(k, k_cache, q.dtype), kv_int8.widen(v, v_cache, q.dtype)
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


@kernel
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_ptr, lse_ptr, scale,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                   stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, split_len,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                   DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = table_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
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
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # the rounding a native bf16/fp16 dot would do
        if DOT_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    has = denom > 0
    out = acc / tl.where(has, denom, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, denom, 1.0)), float("-inf"))
    tl.store(part_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
             + split * stride_ps + d[None, :],
             out.to(part_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@kernel
def _merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=(w > 0)[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def block_n_for(head_dim: int) -> int:
    """Context positions per loop step: K and V tiles of 64 x 128 (bf16: 16 KiB each)."""
    return 64 if head_dim <= 128 else 32


def pick_num_splits(batch: int, kv_heads: int, max_context: int, head_dim: int,
                    device: torch.device) -> int:
    """Enough context splits for about two programs per SM, each split at least 4 tiles long.

    Depends on shapes only (no device sync), so a captured CUDA graph keeps its launch grid.
    """
    block_n = block_n_for(head_dim)
    want = cdiv(2 * sm_count(device), batch * kv_heads)
    most = max(1, cdiv(max_context, 4 * block_n))
    return int(max(1, min(want, most, MAX_SPLITS)))


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, block_size: int, scale: float,
                                  num_splits: int | None = None,
                                  out: torch.Tensor | None = None, *, block_n: int | None = None,
                                  num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q: [B, H, D]; caches [num_slots, KVH, D]; block_tables [B, W] (page ids of `block_size`
    slots each); context_lens [B] (>= 0, <= W * block_size). Returns (or fills `out`) [B, H, D].
    num_splits, block_n, num_warps and num_stages override the launch heuristics (tuning).
    """
    check(q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3,
          lambda: f"q must be [B, H, D] and caches [slots, KVH, D]: {tuple(q.shape)}, "
          f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    check(k_cache.shape == v_cache.shape and k_cache.shape[2] == dim,
          lambda: f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q "
          f"{tuple(q.shape)}")
    check(heads % kv_heads == 0,
          lambda: f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    check_float("q", q)
    check_float("k_cache", k_cache, q.dtype)
    check_float("v_cache", v_cache, q.dtype)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)
    check_index("block_tables", block_tables, 2)
    check_index("context_lens", context_lens, 1)
    check(block_tables.shape[0] == bsz and context_lens.shape[0] == bsz,
          lambda: f"block_tables {tuple(block_tables.shape)} / context_lens "
          f"{tuple(context_lens.shape)} do not have batch {bsz}")
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check(dim <= 256, lambda: f"head dim {dim} > 256 is not supported")
    device = same_device(q, k_cache, v_cache, block_tables, context_lens)
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1,
          "out must match q in shape and dtype, last dim contiguous")
    if bsz == 0:
        return out

    group = heads // kv_heads
    block_d = next_pow2(dim)
    block_g = max(16, next_pow2(group))  # tl.dot needs M >= 16
    block_n = block_n or block_n_for(dim)
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = pick_num_splits(bsz, kv_heads, max_context, dim, device)
    split_len = cdiv(cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = cdiv(max(max_context, 1), split_len)
    dot_f32 = device.type != "cuda" or q.dtype == torch.float32

    if num_splits == 1:  # write straight into the output, nothing to merge
        part = out.unsqueeze(2)
    else:
        part = torch.empty(bsz, heads, num_splits, dim, device=device, dtype=torch.float32)
    lse = torch.empty(bsz, heads, num_splits, device=device, dtype=torch.float32)
    _decode_kernel.on(device)[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), split_len,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE=block_size, DOT_F32=dot_f32, num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_kernel.on(device)[(bsz, heads)](
            part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=4)
    return out


def paged_decode_attention_slots_triton(q: torch.Tensor, k_cache: torch.Tensor,
                                        v_cache: torch.Tensor, slots: torch.Tensor,
                                        valid: torch.Tensor, scale: float,
                                        num_splits: int | None = None,
                                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The runtime's (slots, valid) form: slots is a block table of page size 1 and `valid` a
    prefix mask, so its row sums are the context lengths."""
    check(slots.shape == valid.shape, "slots and valid differ in shape")
    lens = valid.sum(dim=1, dtype=torch.int32)
    return paged_decode_attention_triton(q, k_cache, v_cache, slots, lens, 1, scale,
                                         num_splits=num_splits, out=out)
