"""Kernel tests: every Triton kernel against its torch reference, natively on CUDA, else on
CPU tensors under Triton's interpreter.

The interpreter has to be on before triton is first imported. `kernels._utils` turns it on by
itself on a CPU-only torch build (the only way Triton runs there), whatever imported kernels
first, so nothing here depends on test order. On a CUDA build without a GPU we set it here,
which works when this package is collected first; otherwise the CPU tests skip with a reason.
Nothing is set on a machine with a GPU, so other test packages never run interpreted there.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import _utils  # after the variable above


@pytest.fixture(scope="session")
def device() -> torch.device:
    if not _utils.HAS_TRITON:
        pytest.skip("triton is not installed (pip install -e '.[dev]')")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not _utils.INTERPRETER_READY:
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set")
    return torch.device("cpu")
