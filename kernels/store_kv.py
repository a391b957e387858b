"""Write the new tokens' K and V into the paged cache at their slots.

Triton kernel: one program per (token, tile of KV-head x head-dim elements) copies the token's
K and V rows to its slot, casting to the cache dtype. A negative slot is skipped (padding
tokens of a CUDA-graph batch).
"""
from __future__ import annotations

import torch

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


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_slots, num_kv_heads,
    head_dim] (num_slots = num_blocks * block_size; an int8 cache's rows are head_dim + 4
    bytes, kernels/kv_int8.py); slot_mapping: [num_tokens] int64."""
    if kv_int8.is_int8(k_cache):
        kv_int8.check_width(k_cache, key.shape[-1])
        k_cache.index_copy_(0, slot_mapping, kv_int8.quantize_rows(key))
        v_cache.index_copy_(0, slot_mapping, kv_int8.quantize_rows(value))
        return
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@kernel
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     HEAD_DIM: tl.constexpr, NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = idx < tl.where(slot >= 0, NUMEL, 0)  # nothing for a negative slot
    h = idx // HEAD_DIM
    d = idx % HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + d, k.to(kc_ptr.dtype.element_ty),
             mask=mask)
    tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty),
             mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as `store_kv_ref`; key/value may be strided views (e.g. of a fused qkv)."""
    check(key.dim() == 3 and key.shape == value.shape,
          lambda: f"key/value must be [T, KVH, D] and equal: {tuple(key.shape)}, "
          f"{tuple(value.shape)}")
    check(k_cache.dim() == 3 and k_cache.shape == v_cache.shape
          and k_cache.shape[1:] == key.shape[1:],
          lambda: f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
          f"{tuple(key.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t)
        check_inner_contiguous(name, t)
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache differ in dtype")
    check_index("slot_mapping", slot_mapping, 1)
    check(slot_mapping.shape[0] == key.shape[0],
          lambda: f"{slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    device = same_device(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, kv_heads, dim = key.shape
    if num_tokens == 0:
        return
    numel = kv_heads * dim
    block = min(1024, next_pow2(numel))
    _store_kv_kernel.on(device)[(num_tokens, cdiv(numel, block))](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=dim, NUMEL=numel, BLOCK=block, num_warps=4)
