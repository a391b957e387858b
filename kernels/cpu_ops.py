"""Tensor-level wrappers of the compiled CPU decode ops (kernels/cpu/decode_ops.c).

Each takes and returns torch tensors with the references' contracts (kernels/__init__.py
picks between them); the C side reads data pointers and element strides, so a wrapper checks
dtype, device and the unit inner stride first, and the caller keeps every tensor alive for the
call. The thread count is torch's own (the thread governor sets it), read per call.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from kernels import kv_int8
from kernels.cpu_api import BLOCK_FORMATS, AttentionArgs, StoreKVArgs, bind
from kernels.cpu_build import load

_lib: Any = None  # the bound API once available() built it; every wrapper runs after that check


def available() -> bool:
    global _lib
    if _lib is None:
        raw = load()
        if raw is not None:
            _lib = bind(raw)
    return _lib is not None


def api() -> Any:
    """The typed functions (kernels/cpu_api.py), for the fused layer; after `available()`."""
    return _lib


def accepts(dtype: torch.dtype) -> bool:
    """Whether the C ops take CPU tensors of this dtype: float32, library built."""
    return dtype == torch.float32 and available()


# the KV cache element types the C ops read and write, as simd.h numbers them (int8: rows with
# their scales, kernels/kv_int8.py)
CACHE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def accepts_cache(dtype: torch.dtype) -> bool:
    """Whether the C ops read and write a KV cache of this dtype (float32 queries)."""
    return dtype in CACHE_KINDS and available()


def takes_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C ops read these K and V caches: one dtype they take, unit inner strides,
    the two laid out alike (they are passed one pair of strides)."""
    return (accepts_cache(k_cache.dtype) and k_cache.dtype == v_cache.dtype
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view with a unit inner stride (a copy only when the input has none)."""
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32 times int8 q [N, K] with float32 per-row scale [N] (+ bias [N])."""
    x = _rows(x)
    n, k = q.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    _lib.int8_linear(x.data_ptr(), x.shape[0], x.stride(0), q.data_ptr(), scale.data_ptr(),
                     None if bias is None else bias.data_ptr(), n, k, y.data_ptr(), n,
                     torch.get_num_threads())
    return y


PANEL = 16  # output rows per panel of the packed layout (decode_ops.c)
PANEL_MIN_ROWS = 32  # from here the panel kernel runs (decode_layer.c says why)


def pack_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] as panels of 16 rows stored input-major, [ceil(N/16), K, 16] (rows past N
    are zeros): the layout `int8_linear_panels` reads."""
    n, k = q.shape
    padded = torch.zeros((n + PANEL - 1) // PANEL * PANEL, k, dtype=torch.int8)
    padded[:n] = q
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def int8_linear_panels(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_linear` from the panel layout (`pack_panels`): faster from a few rows up."""
    x = _rows(x)
    n, k = scale.shape[0], panels.shape[1]
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    _lib.int8_linear_panels(x.data_ptr(), x.shape[0], x.stride(0), panels.data_ptr(),
                            scale.data_ptr(), None if bias is None else bias.data_ptr(), n, k,
                            y.data_ptr(), n, torch.get_num_threads())
    return y


# api.h's BLOCK_* codes (kernels/cpu/block_ops.c has the layouts): the split forms' codes are
# their bits, so `Int4Weight.bits` and `Int8BlockWeight.bits` pass as they are
BLOCK_Q4, BLOCK_Q8 = BLOCK_FORMATS["BLOCK_Q4"], BLOCK_FORMATS["BLOCK_Q8"]
BLOCK_Q4_K, BLOCK_Q5_K, BLOCK_Q6_K = (BLOCK_FORMATS[f"BLOCK_Q{b}_K"] for b in (4, 5, 6))
# a K-quant's super-block: 256 inputs in this many bytes (ggml's block_q4_K, _q5_K, _q6_K)
KQUANT_BLOCK = 256
KQUANT_BYTES = {BLOCK_Q4_K: 144, BLOCK_Q5_K: 176, BLOCK_Q6_K: 210}


def block_format(weight) -> int:
    """The BLOCK_* code of a block weight: a K-quant's `format` (runtime/loading/
    kquant_weights.py), else the split forms' `bits` (runtime/loading/quantization.py)."""
    fmt = getattr(weight, "format", None)
    return int(fmt if fmt is not None else weight.bits)


def _block_shape(qs: torch.Tensor, fmt: int) -> tuple[int, int]:
    """(N, K) of a block weight's qs: [N, K/32, 16 or 32] split, [N, K/256, bytes] K-quant."""
    return qs.shape[0], qs.shape[1] * (KQUANT_BLOCK if fmt in KQUANT_BYTES else 32)


def block_linear(x: torch.Tensor, qs: torch.Tensor, fmt: int, d: torch.Tensor | None,
                 m: torch.Tensor | None, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32 times a weight in a GGUF's blocks + bias [N], `fmt` a BLOCK_* code:
    BLOCK_Q4 (4, `Int4Weight`: qs [N, K/32, 16] nibbles and float16 d, m [N, K/32]),
    BLOCK_Q8 (8, `Int8BlockWeight`: qs [N, K/32, 32] int8 and float16 d), or a K-quant
    (runtime/loading/kquant_weights.py: qs the file's super-blocks, uint8 [N, K/256, bytes],
    d and m None). Any step size: larger ones dequantize panels of rows in the kernel.
    `out`: a float32 [T, N] view with a unit inner stride (columns of a wider output) to
    write into instead of a new tensor."""
    x = _rows(x)
    n, k = _block_shape(qs, fmt)
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
    elif out.shape != (x.shape[0], n) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be float32 [{x.shape[0]}, {n}] with a unit inner stride")
    _lib.block_linear(x.data_ptr(), x.shape[0], x.stride(0), qs.data_ptr(), fmt,
                      None if d is None else d.data_ptr(), None if m is None else m.data_ptr(),
                      None if bias is None else bias.data_ptr(), n, k, out.data_ptr(),
                      out.stride(0), torch.get_num_threads())
    return out


def block_dequantize(qs: torch.Tensor, fmt: int, d: torch.Tensor | None = None,
                     m: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `block_linear` multiplies by, as float32 [N, K]: for the K-quants exactly
    the `gguf` package's (and ggml's) dequantization of the same blocks."""
    n, k = _block_shape(qs, fmt)
    w = torch.empty(n, k, dtype=torch.float32)
    _lib.block_dequantize(qs.data_ptr(), fmt, None if d is None else d.data_ptr(),
                          None if m is None else m.data_ptr(), n, k, w.data_ptr(), k,
                          torch.get_num_threads())
    return w


def f32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [T, K] float32 times the float32 weight w [N, K] (unit inner stride) + bias [N]: the
    fused layer's GEMM for a block-quantized model's larger steps, exposed for its tests."""
    x = _rows(x)
    n, k = w.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    _lib.f32_linear(x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(),
                    None if bias is None else bias.data_ptr(), n, k, y.data_ptr(), n,
                    torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    x = _rows(x)
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float32)
    res_out = None
    if residual is not None:
        residual = _rows(residual)
        res_out = torch.empty(t, d, dtype=torch.float32)
    _lib.rms_norm(x.data_ptr(), x.stride(0),
                  None if residual is None else residual.data_ptr(),
                  0 if residual is None else residual.stride(0), weight.data_ptr(),
                  out.data_ptr(), None if res_out is None else res_out.data_ptr(), t, d, eps,
                  torch.get_num_threads())
    return out if residual is None else (out, res_out)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    x = _rows(gate_up)
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    _lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), t, two_i // 2,
                      torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], two_i // 2)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D] in place (inner stride 1) with cos, sin [T, 1, D]; returns x."""
    t, h, d = x.shape
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    _lib.rotary(x.data_ptr(), t, h, d, x.stride(0), x.stride(1), cos.data_ptr(),
                sin.data_ptr())
    return x


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """float32 key, value [T, KVH, D] (inner stride 1) into caches [slots, KVH, D] of a
    `CACHE_KINDS` dtype at slot_mapping (negative slots skipped), rounded as torch casts."""
    t, kvh, d = key.shape
    kv_int8.check_width(k_cache, d)
    slot_mapping = slot_mapping.contiguous()
    # by field name: a reordered struct in api.h cannot shift these into the wrong fields
    args = StoreKVArgs(k=key.data_ptr(), v=value.data_ptr(), k_row=key.stride(0),
                       k_head=key.stride(1), v_row=value.stride(0), v_head=value.stride(1),
                       k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                       cache_slot=k_cache.stride(0), cache_head=k_cache.stride(1),
                       kind=CACHE_KINDS[k_cache.dtype])
    _lib.store_kv(ctypes.byref(args), slot_mapping.data_ptr(), t, kvh, d)


def _attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, block_size: int, scale: float,
                    out: torch.Tensor, window: int = 0) -> AttentionArgs:
    """The C struct of q and out [rows, H, D], the caches [slots, KVH, D] and the tables
    (`window` > 0: each query sees only that many positions back, its own included)."""
    kv_int8.check_width(k_cache, q.shape[2])
    return AttentionArgs(window=window,
        q=q.data_ptr(), q_row=q.stride(0), q_head=q.stride(1), k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(), cache_slot=k_cache.stride(0), cache_head=k_cache.stride(1),
        kind=CACHE_KINDS[k_cache.dtype], tables=tables.data_ptr(), table_stride=tables.stride(0),
        page=block_size, heads=q.shape[1], kv_heads=k_cache.shape[1], head_dim=q.shape[2],
        scale=scale, out=out.data_ptr(), out_row=out.stride(0), out_head=out.stride(1))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     scale: float, out: torch.Tensor | None = None,
                     window: int = 0) -> torch.Tensor:
    """q [B, H, D] against caches [slots, KVH, D] of a `CACHE_KINDS` dtype; tables [B, W],
    lens [B] int64; a `window` > 0 limits each query to its last `window` positions."""
    b, h, d = q.shape
    if out is None:
        out = torch.empty(b, h, d, dtype=torch.float32)
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lens = context_lens.contiguous()
    args = _attention_args(q, k_cache, v_cache, tables, block_size, scale, out, window)
    failed = _lib.decode_attention(ctypes.byref(args), lens.data_ptr(), b,
                                   torch.get_num_threads())
    if failed:
        raise MemoryError("decode attention could not allocate its score buffer")
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, block_size: int, cu_seqlens_q: torch.Tensor,
                      num_prefix: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Chunk i's rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q [T, H, D] at positions
    num_prefix[i].. against its context in caches [slots, KVH, D] (the rows' own K/V stored
    first), causal (and within `window` positions, when > 0); tables [C, W]. Other rows of
    `out` are left alone."""
    t, h, d = q.shape
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.float32)
    tables = block_tables.to(torch.int64).contiguous()
    starts = cu_seqlens_q.to(torch.int64).contiguous()
    prefix = num_prefix.to(torch.int64).contiguous()
    args = _attention_args(q, k_cache, v_cache, tables, block_size, scale, out, window)
    failed = _lib.prefill_attention(ctypes.byref(args), starts.data_ptr(), prefix.data_ptr(),
                                    tables.shape[0], torch.get_num_threads())
    if failed:
        raise MemoryError("prefill attention could not allocate its state")
    return out
