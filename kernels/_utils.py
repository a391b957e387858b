"""Shared launcher plumbing: Triton if installed, its interpreter for CPU tensors, input checks.

`kernel` wraps a Triton kernel so that one launcher serves both devices: on CUDA tensors it runs
the compiled kernel, on CPU tensors Triton's interpreter (chosen per launch from the tensor's
device). Triton is imported at a kernel's first launch, never at import: a process that runs
only the CPU ops or the references (a CPU worker) does without it, and without triton installed
the kernel modules still import; only launching raises.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# `tl` stands for triton.language in the kernel modules until a kernel first runs: the kernels'
# annotations are strings (postponed) and their bodies are read only when compiled, so no
# module needs triton at import. A CPU worker never imports it (it costs 0.1 s and leaves
# nanobind's leak report on every exit); `_Kernel.on` loads it and puts the real module in
# its kernel's module.
tl: Any = SimpleNamespace(constexpr=object)
_loaded: tuple[Any, Any, bool] | None = None  # (triton, triton.language, interpreted)


# Triton decorates its own library helpers (tl.zeros, tl.sum, ...) when it is imported, for the
# interpreter only if TRITON_INTERPRET=1 is set then, and some of its modules check the variable
# again when imported later. A CPU-only torch build can run Triton in no other way, so there
# TRITON_INTERPRET defaults to 1 for the process, set here, before anything may import triton
# (this module does so only at a kernel's first launch), and left set. On CUDA builds nothing
# is changed; set TRITON_INTERPRET=1 yourself to run the kernels on CPU tensors there.
if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _import_triton() -> tuple[Any, Any, bool]:
    """Import triton once; on a CPU-only torch build, with its interpreter on (below)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        import triton
        import triton.language as language
        from triton.runtime.jit import JITFunction
    except ImportError:  # the references still work; launching a kernel raises
        _loaded = (None, tl, False)
        return _loaded
    # whoever imported triton first decided: its helpers are compiled-only JIT functions unless
    # the interpreter was on then
    _loaded = (triton, language, not isinstance(getattr(language, "zeros", None), JITFunction))
    return _loaded


def __getattr__(name: str):
    """INTERPRETER_READY (whether Triton interprets kernels on CPU tensors) imports triton to
    find out, so only a caller that asks pays for it (the kernel tests do)."""
    if name == "INTERPRETER_READY":
        return _import_triton()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launch grids (triton.cdiv, without importing triton)."""
    return -(-a // b)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Kernel:
    """A Triton kernel compiled for CUDA tensors and interpreted for CPU tensors; triton is
    imported at the first launch, not before."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self._interpreted = None

    def on(self, device: torch.device):
        triton, language, interpreted = _import_triton()
        if triton is None:
            raise RuntimeError("triton is not installed; use the *_ref functions")
        if self.fn.__globals__.get("tl") is tl:  # the stand-in: its module gets the real one
            self.fn.__globals__["tl"] = language
        if device.type == "cuda":
            if self._compiled is None:
                self._compiled = triton.jit(self.fn)
            return self._compiled
        if not interpreted:
            raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter: "
                               "set TRITON_INTERPRET=1 before triton is first imported")
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted


def kernel(fn) -> _Kernel:
    """Decorator of the private kernels; launch with `_kernel.on(device)[grid](...)`."""
    return _Kernel(fn)


def check(cond: bool, msg: str | Callable[[], str]) -> None:
    """Raise ValueError(msg) unless `cond`. A message naming shapes is passed as a lambda, so
    it is formatted only on failure: an f-string with shapes costs microseconds on every
    launch, and a decode step makes hundreds of launches."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one of {FLOAT_DTYPES}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype} differs from {dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: dtype {t.dtype} is not int32/int64")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, strides {t.stride()}")


def same_device(*tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"tensors on different devices: {dev} and {t.device}")
    return dev


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
