"""The one place that picks an implementation for each op.

The choice is made per call from the device of the op's first tensor: Triton kernels for CUDA
tensors (when triton imports), the compiled CPU ops (kernels/cpu/*.c, built at
first use) for float32 CPU tensors on AVX2 + FMA machines, the torch references for anything
else. Environment variable INFERSTACK_KERNELS (read once, at import):
  ""/unset  the rule above;
  "ref"     always the references (FORCE_REFERENCE): the same code with the kernels off;
  "ops"     the compiled CPU ops one by one, never the fused decode layer (NO_FUSED_LAYER);
  "triton"  Triton for CPU tensors too, through its interpreter (slow; for checking the
            runtime's calls against the kernels on a machine without a GPU).
Callers import the op names from here and never from the files directly. What an attention
choice reads besides the block tables is built here too, once per step (`decode_slots`,
`prefill_plan`): the references' slot matrices on the CPU, nothing for the Triton kernels.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpu_build, cpu_ops
from kernels._utils import HAS_TRITON
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.paged_attention import (
    context_slots,
    paged_decode_attention_ref,
    paged_decode_attention_slots_triton,
    paged_decode_attention_triton,
)
from kernels.prefill_attention import (
    VarlenSeq,
    prefill_attention_ref,
    prefill_attention_triton,
    prefill_attention_varlen_ref,
    prefill_attention_varlen_triton,
    varlen_slots,
)
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin
from kernels.store_kv import store_kv_ref, store_kv_triton

_MODE = os.environ.get("INFERSTACK_KERNELS", "").lower()
FORCE_REFERENCE = _MODE == "ref"
FORCE_TRITON = _MODE == "triton" and HAS_TRITON
NO_FUSED_LAYER = _MODE == "ops"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor `t` runs its Triton kernel."""
    if FORCE_REFERENCE or not HAS_TRITON:
        return False
    return t.is_cuda or FORCE_TRITON


def cpu_ops_take(dtype: torch.dtype) -> bool:
    """Whether CPU tensors of this dtype run the compiled CPU decode ops."""
    return not FORCE_REFERENCE and not FORCE_TRITON and cpu_ops.accepts(dtype)


def use_cpu_ops(t: torch.Tensor) -> bool:
    """Whether an op on tensor `t` runs the compiled CPU decode ops."""
    return t.device.type == "cpu" and cpu_ops_take(t.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x + residual) * weight, and the new residual x + residual when one is given."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    if use_cpu_ops(x) and weight.dtype == torch.float32:
        return cpu_ops.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Returns x [T, heads, D] rotated. The Triton path rotates x in place and returns it, the
    reference returns a new tensor: use the result, and do not read x afterwards."""
    if use_triton(x):
        return apply_rotary_triton(x, cos, sin)
    if use_cpu_ops(x) and x.stride(-1) == 1 and cos.dtype == torch.float32:
        return cpu_ops.apply_rotary_(x, cos, sin)
    return apply_rotary_ref(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    if use_cpu_ops(gate_up):
        return cpu_ops.silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if use_triton(key):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif _cpu_cache_op(key, k_cache, v_cache) and value.stride(-1) == 1:
        cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def _cpu_cache_op(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C ops can read x (float32, unit inner stride) and the caches
    (`cpu_ops.takes_caches`)."""
    return use_cpu_ops(x) and x.stride(-1) == 1 and cpu_ops.takes_caches(k_cache, v_cache)


def windows_in_kernels(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged attention of q against these caches takes a sliding `window` itself (the
    C kernels do; the Triton and reference ones do not, and their windowed layers take
    runtime/models/window_attention.py's path)."""
    return not use_triton(q) and _cpu_cache_op(q, k_cache, v_cache)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None,
                panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times the int8 weight q [N, K] with float32 per-row scales [N] (+ bias):
    the C GEMM on float32 activations (from `panels`, q's panel layout, for larger steps),
    else torch's kernel on bfloat16 ones."""
    if use_cpu_ops(x):
        if panels is not None and x.shape[0] >= cpu_ops.PANEL_MIN_ROWS:
            return cpu_ops.int8_linear_panels(x, panels, scale, bias)
        return cpu_ops.int8_linear(x, q, scale, bias)
    y = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scale.to(torch.bfloat16)).to(x.dtype)
    return y if bias is None else y + bias


def block_matmul(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times a weight in a GGUF's own blocks (runtime.loading.quantization's Int4Weight or
    Int8BlockWeight): the C kernel on float32 activations, else the float matmul of its
    dequantization (the same products, slowly)."""
    if use_cpu_ops(x):
        return cpu_ops.block_linear(x, weight.qs, weight.bits, weight.d, weight.m, bias)
    return F.linear(x, weight.dequantized().to(x.dtype), bias)


def int8_kernel(x_dtype: torch.dtype) -> str:
    """The name of what `int8_matmul` runs for activations of this dtype on the CPU (the
    crossover table keys its timings by it)."""
    return f"decode_ops-{cpu_build.source_key()}" if cpu_ops_take(x_dtype) else "torch"


def fused_decoder(layers, dtype: torch.dtype):
    """The fused CPU decode layer for these decoder layers (kernels/cpu_layer.py), or None
    where it cannot run them or the mode turns it off; the model asks it step by step."""
    if FORCE_REFERENCE or FORCE_TRITON or NO_FUSED_LAYER:
        return None
    from kernels.cpu_layer import FusedDecoder
    return FusedDecoder.build(layers, dtype)


def decode_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 max_len: int | None = None, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What decode attention reads besides the block tables, built once per step for every
    layer: the reference's [B, L] slots and mask (a gather, then SDPA: the fastest decode on
    the CPU), or (None, None) where the Triton kernel or the C op (queries of `dtype`) runs,
    which read the tables themselves.
    `max_len` is the longest context (the host knows it; without it the reference syncs)."""
    if use_triton(block_tables) or cpu_ops_take(dtype):
        return None, None
    return context_slots(block_tables, context_lens, block_size, max_len)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor | None, valid: torch.Tensor | None,
                           scale: float, *, block_tables: torch.Tensor | None = None,
                           context_lens: torch.Tensor | None = None,
                           block_size: int | None = None,
                           out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q [B, H, D] against the paged cache. Give block_tables [B, W] + context_lens [B] +
    block_size (what the Triton kernel reads) and (slots, valid) from `decode_slots` (what the
    reference reads; built from the tables here when None), or only (slots, valid). Returns
    the result, written into `out` when one is given. A `window` > 0 is for the C kernel
    only (`windows_in_kernels`)."""
    page = block_size if block_size is not None else 16
    if window and not windows_in_kernels(q, k_cache, v_cache):
        raise ValueError("this paged attention kernel has no sliding window")
    if use_triton(q):
        if block_tables is not None and context_lens is not None:
            return paged_decode_attention_triton(q, k_cache, v_cache, block_tables,
                                                 context_lens, page, scale, out=out)
        return paged_decode_attention_slots_triton(q, k_cache, v_cache, slots, valid, scale,
                                                   out=out)
    if (block_tables is not None and context_lens is not None
            and _cpu_cache_op(q, k_cache, v_cache)):
        return cpu_ops.decode_attention(q, k_cache, v_cache, block_tables, context_lens, page,
                                        scale, out=out, window=window)
    if slots is None:
        slots, valid = context_slots(block_tables, context_lens, page)
    result = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    return result if out is None else out.copy_(result)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, num_prefix: int, scale: float,
                      k_new: torch.Tensor | None = None,
                      v_new: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's chunk q [n, H, D] at positions num_prefix.. against its cached context."""
    if use_triton(q):
        return prefill_attention_triton(q, k_cache, v_cache, slots, num_prefix, scale)
    return prefill_attention_ref(q, k_cache, v_cache, slots, num_prefix, scale, k_new, v_new)


def prefill_plan(block_tables: torch.Tensor, block_size: int, cu_seqlens_q: torch.Tensor,
                 num_prefix: torch.Tensor, dtype: torch.dtype = torch.float32
                 ) -> list[VarlenSeq] | None:
    """What varlen prefill reads besides the tables, built once per step for every layer: the
    reference's per-sequence slots (`varlen_slots`), or None where the Triton kernel or the C
    op (queries of `dtype`) runs, which read the tables themselves."""
    if use_triton(block_tables) or cpu_ops_take(dtype):
        return None
    return varlen_slots(block_tables, block_size, cu_seqlens_q, num_prefix)


def prefill_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, block_size: int,
                             cu_seqlens_q: torch.Tensor, num_prefix: torch.Tensor,
                             scale: float, max_q_len: int | None = None, *,
                             seqs: list[VarlenSeq] | None = None,
                             k_new: torch.Tensor | None = None,
                             v_new: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """All prefill chunks of a step in one call: q [T, H, D], sequence i owning rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] at positions num_prefix[i]... (see the kernel file);
    other rows of `out` are left alone. The reference reads `seqs` from `prefill_plan` and
    the rows' own k_new/v_new where a sequence has no prefix; the Triton kernel and the C op
    (kernels/cpu/attention.c) read the cache (the new K/V are stored first). A `window` > 0
    is for the C op only (`windows_in_kernels`)."""
    if window and not windows_in_kernels(q, k_cache, v_cache):
        raise ValueError("this prefill attention kernel has no sliding window")
    if use_triton(q):
        return prefill_attention_varlen_triton(q, k_cache, v_cache, block_tables, block_size,
                                               cu_seqlens_q, num_prefix, scale, max_q_len,
                                               out=out)
    if _cpu_cache_op(q, k_cache, v_cache):
        return cpu_ops.prefill_attention(q, k_cache, v_cache, block_tables, block_size,
                                         cu_seqlens_q, num_prefix, scale, out=out,
                                         window=window)
    return prefill_attention_varlen_ref(q, k_cache, v_cache, block_tables, block_size,
                                        cu_seqlens_q, num_prefix, scale, max_q_len, seqs=seqs,
                                        k_new=k_new, v_new=v_new, out=out)


__all__ = [
    "rms_norm", "apply_rotary", "rotary_cos_sin", "silu_and_mul", "store_kv",
    "paged_decode_attention", "prefill_attention", "prefill_attention_varlen", "context_slots",
    "decode_slots", "prefill_plan", "windows_in_kernels", "int8_matmul", "block_matmul",
    "int8_kernel", "use_cpu_ops",
    "fused_decoder",
    "FORCE_REFERENCE", "FORCE_TRITON", "NO_FUSED_LAYER", "HAS_TRITON", "use_triton",
]
