"""Shared launcher plumbing: Triton if installed, its interpreter for CPU tensors, input checks.

`kernel` wraps a Triton kernel so that one launcher serves both devices: on CUDA tensors it runs
the compiled kernel, on CPU tensors Triton's interpreter (chosen per launch from the tensor's
device). Without triton installed the kernel modules still import; only launching raises.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch


def _import_triton():
    """Import triton; on a CPU-only torch build, with its interpreter on.

    Triton decorates its own library helpers (tl.zeros, tl.sum, ...) when it is imported, for
    the interpreter only if TRITON_INTERPRET=1 is set then, and some of its modules check the
    variable again when imported later. A CPU-only torch build can run Triton in no other way,
    so there TRITON_INTERPRET defaults to 1 for the process (set before the import, left set).
    On CUDA builds nothing is changed; set TRITON_INTERPRET=1 yourself to run the kernels on CPU
    tensors there.
    """
    if torch.version.cuda is None and torch.version.hip is None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        import triton.language as tl
        from triton.runtime.jit import JITFunction
    except ImportError:  # the references still work; launching a kernel raises
        return None, SimpleNamespace(constexpr=object), False
    # whoever imported triton first decided: its helpers are compiled-only JIT functions unless
    # the interpreter was on then
    interpreted = not isinstance(getattr(tl, "zeros", None), JITFunction)
    return triton, tl, interpreted


triton, tl, INTERPRETER_READY = _import_triton()
HAS_TRITON = triton is not None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Kernel:
    """A Triton kernel compiled for CUDA tensors and interpreted for CPU tensors."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = triton.jit(fn) if HAS_TRITON else None
        self._interpreted = None

    def on(self, device: torch.device):
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed; use the *_ref functions")
        if device.type == "cuda":
            return self._compiled
        if not INTERPRETER_READY:
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
