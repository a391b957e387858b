"""The compiled CPU library's API as ctypes sees it: kernels/cpu/api.h's structs mirrored field
by field, and each exported function's argument and result types.

ctypes trusts these tables blindly: a field or an argument out of step with the C side passes
garbage through a pointer instead of failing. tests/kernels/test_bindings.py therefore parses
api.h and compares it with `STRUCTS` and `SIGNATURES` in both directions, and the built
library's export list with both; edit the header and this file together.
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# api.h's BLOCK_* weight formats of the block kernels (kernels/cpu/block_ops.c has the layouts):
# the split forms keep their old `bits` as codes, a file's K-quant super-blocks ggml's type
# numbers (tests/kernels/test_bindings.py reads the header's enum against this table)
BLOCK_FORMATS = {"BLOCK_Q4": 4, "BLOCK_Q8": 8, "BLOCK_Q4_K": 12, "BLOCK_Q5_K": 13,
                 "BLOCK_Q6_K": 14}


class Matrix(ctypes.Structure):
    """One projection (a chain of them where its rows come in several block formats)."""


Matrix._fields_ = [("q", _P), ("panels", _P), ("scale", _P), ("bias", _P), ("n", _I), ("k", _I),
                   ("qs", _P), ("d16", _P), ("m16", _P), ("format", _I), ("small_rows", _I),
                   ("dense", _P), ("next", ctypes.POINTER(Matrix))]


class LayerWeights(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", _F), ("attn_scale", _F), ("input_norm", _P),
                ("post_norm", _P), ("qkv", Matrix), ("o_proj", Matrix),
                ("gate_up", Matrix), ("down", Matrix)]


class StepCache(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("k_cache", _P), ("v_cache", _P),
                ("cache_slot", _I), ("cache_head", _I), ("slots", _P), ("tables", _P),
                ("lens", _P), ("table_stride", _I), ("page", _I), ("kind", _I)]


class AttentionArgs(ctypes.Structure):
    """q and out [rows, H, D], the paged caches and their tables (attention.c)."""
    _fields_ = [("q", _P), ("q_row", _I), ("q_head", _I), ("k_cache", _P), ("v_cache", _P),
                ("cache_slot", _I), ("cache_head", _I), ("kind", _I), ("tables", _P),
                ("table_stride", _I), ("page", _I), ("heads", _I), ("kv_heads", _I),
                ("head_dim", _I), ("scale", _F), ("out", _P), ("out_row", _I),
                ("out_head", _I), ("window", _I)]


class StoreKVArgs(ctypes.Structure):
    """New K/V rows [T, KVH, D] and the caches they go into (decode_ops.c)."""
    _fields_ = [("k", _P), ("v", _P), ("k_row", _I), ("k_head", _I), ("v_row", _I),
                ("v_head", _I), ("k_cache", _P), ("v_cache", _P), ("cache_slot", _I),
                ("cache_head", _I), ("kind", _I)]


STRUCTS = (Matrix, LayerWeights, StepCache, AttentionArgs, StoreKVArgs)

_ATTN, _STORE = ctypes.POINTER(AttentionArgs), ctypes.POINTER(StoreKVArgs)
# name: (argument types, result type); a pointer to one of STRUCTS is typed as such, so ctypes
# refuses any other struct passed in its place
SIGNATURES = {
    "is_int8_linear": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _I, _C], None),
    "is_int8_linear_panels": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _I, _C], None),
    "is_block_linear": ([_P, _I, _I, _P, _C, _P, _P, _P, _I, _I, _P, _I, _C], None),
    "is_block_dequantize": ([_P, _C, _P, _P, _I, _I, _P, _I, _C], None),
    "is_f32_linear": ([_P, _I, _I, _P, _P, _I, _I, _P, _I, _C], None),
    "is_rms_norm": ([_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _C], None),
    "is_silu_and_mul": ([_P, _I, _P, _I, _I, _C], None),
    "is_rotary": ([_P, _I, _I, _I, _I, _I, _P, _P], None),
    "is_store_kv": ([_STORE, _P, _I, _I, _I], None),
    "is_decode_attention": ([_ATTN, _P, _I, _C], _C),
    "is_prefill_attention": ([_ATTN, _P, _P, _I, _C], _C),
    "is_decode_layer": ([ctypes.POINTER(LayerWeights), _P, _P, _C,
                         ctypes.POINTER(StepCache), _I, _P, _C], _C),
}


def bind(lib: ctypes.CDLL) -> SimpleNamespace:
    """The library's functions typed from `SIGNATURES`, named without the `is_` prefix."""
    bound = {}
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
        bound[name[3:]] = fn
    return SimpleNamespace(**bound)
