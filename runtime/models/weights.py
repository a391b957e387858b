"""How a checkpoint's tensors become the model's weights: `ModelWeights` reads each tensor as
the model asks for it (a GGUF's quantized matrices as the file's own blocks), `LinearMaker`
turns a matrix (or the parts of a fused one) into a `runtime/models/linear.py` Linear in the
served form, resident once (a file's blocks without a float copy; parts of several block forms
stacked as `StackedBlocks`), and the start-up line says what was built and how long it took.
Every model family builds its projections here, so the forms and their crossovers are decided once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import kernels
from runtime.loading.calibration import Calibration
from runtime.loading.quantization import (
    INT4_GROUP,
    BlockWeight,
    Int4Weight,
    Int8BlockWeight,
    Int8Weight,
    StackedBlocks,
)
from runtime.models.linear import Linear

log = logging.getLogger("runtime.startup")


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the weights' reading and float copies on one intra-op thread: they are many small,
    memory-bound ops, and with another process on the second core every op's OpenMP barrier
    waits out a scheduler slice (dequantizing SmolLM2 took 12-20 s on two threads beside a
    test run, 0.6 s on one; runtime/execution/thread_governor.py describes the effect)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def log_build(linear: LinearMaker, w: ModelWeights, build_s: float, crossover_s: float):
    forms = ", ".join(f"{form} {n}" for form, n in linear.forms.items())
    floats = sum(lin.float_bytes for lin in linear.made)
    blocks = sum(lin.small.nbytes for lin in linear.made if lin.small is not None)
    log.info("model built in %.2f s (tensors read %.2f s, float weights %.2f s, %d MiB; "
             "blocks %d MiB): %d matrices as %s; %d vectors", build_s, w.read_seconds,
             linear.float_seconds, floats >> 20, blocks >> 20, len(linear.made), forms,
             w.vectors)
    for kind, e in linear.approximations.items():
        log.info("%s matrices served approximately (%d re-derived in 8-bit blocks): max abs "
                 "error %.3g, RMS relative error %.3g against the file's weights", kind,
                 e.matrices, e.max_abs, e.rms_relative)
    c = linear.calibration
    saved = {"settled": f"saved to {c.path}", "provisional":
             f"the machine is busy: kept as provisional in {c.busy_path}"}.get(c.saved_as,
                                                                                "not saved")
    if c.measured:
        log.info("kernel crossovers: %d shapes measured in %.1f s (%s)", c.measured, c.seconds,
                 saved)
    elif linear.max_quant_rows is None and any(lin.packed is not None for lin in linear.made):
        log.info("kernel crossovers: read from %s in %.2f s", c.busy_path + " (provisional: "
                 "the machine is busy)" if c.used_provisional else c.path, crossover_s)


class ModelWeights:
    """The checkpoint's tensors as the model takes them: float on the model's device and in
    its dtype, or, for a matrix, the file's own blocks where the checkpoint's mapping offers
    them (runtime/loading/gguf.py `GGUFWeights.blocks`): read once, in the form served."""

    def __init__(self, weights: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.weights, self.device, self.dtype = weights, device, dtype
        self._blocks = getattr(weights, "blocks", None)
        self.read_seconds = 0.0  # reading (and dequantizing) tensors, for the start-up line
        self.vectors = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def tensor(self, name: str) -> torch.Tensor:
        start = time.perf_counter()
        t = self.weights[name].to(device=self.device, dtype=self.dtype)
        self.read_seconds += time.perf_counter() - start
        self.vectors += t.dim() == 1
        return t

    def matrix(self, name: str) -> torch.Tensor | BlockWeight:
        if self._blocks is None:
            return self.tensor(name)
        start = time.perf_counter()
        blocks = self._blocks(name)
        self.read_seconds += time.perf_counter() - start
        return blocks if blocks is not None else self.tensor(name)


class LinearMaker:
    """Builds the model's Linears in one format: a file's blocks alone (int4: the block
    kernels run every step size), int8 per row with its float dequantization (the large-step
    path) and the measured crossover between them, or float."""

    def __init__(self, quantization: str, dtype: torch.dtype, calibration: Calibration | None,
                 max_quant_rows: int | None, device: torch.device | None = None):
        self.quantization = quantization
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.calibration = calibration or Calibration(None)
        self.max_quant_rows = max_quant_rows  # None: measured per shape
        self.packed_bytes = 0
        self.made: list[Linear] = []
        self.forms: dict[str, int] = {}  # matrices by the form served, for the start-up line
        self.float_seconds = 0.0  # making the float copies
        # the file's types served approximately (runtime/loading/gguf_blocks.py), by type
        self.approximations: dict[str, Any] = {}

    def __call__(self, parts: Sequence[torch.Tensor | BlockWeight],
                 bias: torch.Tensor | None = None) -> Linear:
        """The Linear of `parts` stacked along N (one matrix, or fused q/k/v, gate/up).
        Its crossover is set later, by `set_crossovers`."""
        small = self._file_blocks(parts)
        if small is not None:  # the file's own blocks, at every step size
            linear = Linear(None, bias, small=small)
            self._note(f"{small.kind} (file blocks)", small.nbytes)
        else:
            linear = self._from_float(self._float(parts), bias)
        self.made.append(linear)
        return linear

    def _from_float(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A float weight's Linear, in the format asked for (the path of every weight a
        checkpoint holds in float, or in blocks not served as such)."""
        if self.quantization == "none":
            self._note("float", 0)
            return Linear(weight.contiguous(), bias)
        small = self._exact_blocks(weight)
        if small is not None:  # int4: the blocks a float weight holds exactly, alone
            self._note(f"{small.kind} (from float)", small.nbytes)
            return Linear(None, bias, small=small)
        packed = Int8Weight(weight)
        self._note(packed.kind, packed.nbytes)
        return Linear(packed.dequantized().to(self.dtype).contiguous(), bias, packed)

    def set_crossovers(self) -> None:
        """Each int8 Linear's crossover, measured (or found in the calibration's table) once
        every weight is in place, with the thread count the steps will use. Block weights
        have none: their kernel runs every step size."""
        for linear in self.made:
            if linear.packed is not None:
                linear.max_quant_rows = self._crossover("int8", linear.weight, linear.packed)

    def _crossover(self, kind: str, dense: torch.Tensor, packed: Int8Weight) -> int:
        if self.max_quant_rows is not None:
            return self.max_quant_rows
        return self.calibration.max_quant_rows(kind, dense, packed)

    def _file_blocks(self, parts: Sequence[torch.Tensor | BlockWeight]) -> BlockWeight | None:
        """With int4 where the C kernel runs, the parts' blocks stacked: one matrix where
        they came in one block form, else each run of one form joined and the runs chained
        (`StackedBlocks`); None where a part is float (a float path takes them)."""
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if not self._serves_blocks() or len(blocks) != len(parts):
            return None
        runs: list[list] = []
        for b in blocks:
            if runs and type(runs[-1][0]) is type(b) and not isinstance(b, StackedBlocks):
                runs[-1].append(b)
            else:
                runs.append([b])
        for b in blocks:
            e = getattr(b, "error", None)
            if e is not None:
                seen = self.approximations.get(e.ggml_type)
                self.approximations[e.ggml_type] = e if seen is None else seen + e
        joined = [type(run[0]).cat(run) if len(run) > 1 else run[0] for run in runs]
        return joined[0] if len(joined) == 1 else StackedBlocks(joined)

    def _float(self, parts: Sequence[torch.Tensor | BlockWeight]) -> torch.Tensor:
        def one(p: torch.Tensor | BlockWeight) -> torch.Tensor:
            if isinstance(p, BlockWeight):  # the file's weights (not an approximation's)
                exact = getattr(p, "file_weights", None) or p.dequantized
                return self._timed(lambda: exact().to(self.device, self.dtype))
            return p
        floats = [one(p) for p in parts]
        return floats[0] if len(floats) == 1 else torch.cat(floats)

    def _timed(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        t = make()
        self.float_seconds += time.perf_counter() - start
        return t

    def _note(self, form: str, nbytes: int) -> None:
        self.forms[form] = self.forms.get(form, 0) + 1
        self.packed_bytes += nbytes

    def _serves_blocks(self) -> bool:
        return self.quantization == "int4" and self.device.type == "cpu" \
            and kernels.cpu_ops_take(self.dtype)

    def _exact_blocks(self, weight: torch.Tensor) -> BlockWeight | None:
        """With int4, a float weight in the block form that holds it exactly (4-bit, else
        8-bit), where the C kernel runs it; a weight neither form holds exactly (a float
        checkpoint's) goes int8 per row instead: nothing is rounded to fit a block."""
        if not self._serves_blocks() or weight.shape[1] % INT4_GROUP \
                or weight.device.type != "cpu":
            return None
        for form in (Int4Weight, Int8BlockWeight):
            small = form(weight)
            if small.exact:
                return small
        return None
