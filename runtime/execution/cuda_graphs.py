"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step of a small model on a GPU is mostly kernel launches (about ten per layer); a
graph replays them all in one. Each bucket's graph reads one static device buffer laid out as
a packed step of exactly that many rows (runtime/execution/step_inputs.py) with block tables as
wide as the longest sequence can be, so a step fits by being padded: its rows first, then padding
rows that store their K/V in the padding page and read only it. Graphs are captured at start,
largest first, after a warm-up run of the same inputs (which also compiles the kernels), all
inputs being padding rows then, so capture touches no request's KV. A step replays the
smallest bucket that holds it and slices its rows off the output; anything else (prefill
chunks, speculative verification, more rows than the largest bucket) runs eagerly.

The graphs need launches with no host sync and grids fixed by shapes: the Triton path has
both (the decode split count depends on the table width only). The torch references read
per-step host values (the longest context), so graphs are used only where Triton runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import kernels
from runtime.execution.step_inputs import HostStep, StepLayout, StepTensors, pack, to_device, views
from runtime.scheduling.output import ScheduledRequest

Forward = Callable[[StepTensors, StepLayout], torch.Tensor]  # packed inputs -> hidden [rows, H]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every multiple of 8 up to 64, of 32 beyond, and the
    largest batch itself; padding then costs at most 8 rows up to 64 and an eighth beyond."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(96, max_num_seqs + 1, 32))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def pick_bucket(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_rows` rows, None when none does."""
    for size in sorted(sizes):
        if size >= num_rows:
            return size
    return None


def is_decode_step(batch: Sequence[ScheduledRequest]) -> bool:
    """Only steps of one token per request replay a graph (no chunk, no proposals)."""
    return bool(batch) and all(s.num_new_tokens == 1 for s in batch)


def pack_padded(batch: Sequence[ScheduledRequest], rows: int, block_size: int, width: int,
                pad_block: int) -> HostStep:
    """A decode step packed as bucket `rows`: what its graph's static buffer holds."""
    return pack(batch, block_size, rows=rows, width=width, pad_block=pad_block)


class DecodeGraphs:
    """One captured graph per bucket over one static input buffer; `run` replays."""

    def __init__(self, forward: Forward, device: torch.device, block_size: int, width: int,
                 pad_block: int, sizes: Sequence[int]):
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.width = width  # table width of every bucket: the longest possible sequence
        self.pad_block = pad_block
        self.sizes = sorted(sizes)
        # the largest bucket's inputs, then room for its sample rows (read after the replay)
        largest = self._padding(self.sizes[-1]).layout.size + self.sizes[-1]
        self.static = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}

    @staticmethod
    def supported(device: torch.device) -> str | None:
        """Why graphs cannot run on `device`, or None when they can."""
        if device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if not kernels.use_triton(torch.empty(0, device=device)):
            return "the torch reference kernels sync per step: graphs need the Triton path"
        return None

    def _padding(self, rows: int) -> HostStep:
        return pack_padded((), rows, self.block_size, self.width, self.pad_block)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):  # largest first: the others reuse its memory
            host = self._padding(rows)
            to_device(host.values, self.device, self.static)
            inputs = views(self.static, host.layout)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles kernels, settles the allocator
                for _ in range(2):
                    self.forward(inputs, host.layout)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(inputs, host.layout)
            self.graphs[rows] = (graph, hidden, host.layout.model_size)
        torch.cuda.synchronize(self.device)

    def bucket_for(self, batch: Sequence[ScheduledRequest]) -> int | None:
        """The bucket a step replays, or None when it must run eagerly: not a decode step,
        more rows than the largest bucket, or a table wider than the graphs'."""
        if not is_decode_step(batch) or max(len(s.block_ids) for s in batch) > self.width:
            return None
        return pick_bucket(len(batch), self.sizes)

    def load(self, batch: Sequence[ScheduledRequest], rows: int) -> HostStep:
        """The step padded to bucket `rows`, copied into the static buffer (one transfer)."""
        host = pack_padded(batch, rows, self.block_size, self.width, self.pad_block)
        to_device(host.values, self.device, self.static)
        return host

    def run(self, batch: Sequence[ScheduledRequest],
            fill: Callable[[HostStep, torch.Tensor], None] | None = None
            ) -> tuple[torch.Tensor, HostStep, StepTensors] | None:
        """The step's hidden states [len(batch), H] by replaying a graph, with its packed
        inputs, or None when the step does not fit one (run it eagerly). `fill` writes
        placeholder tokens into the loaded input ids on the device
        (runtime/execution/overlap.py)."""
        rows = self.bucket_for(batch)
        if rows is None or rows not in self.graphs:
            return None
        graph, hidden, size = self.graphs[rows]
        host = self.load(batch, rows)
        if host.layout.model_size != size:  # cannot be: the layout is the bucket's and width's
            raise RuntimeError(f"bucket {rows}: packed {host.layout.model_size} values, the "
                               f"graph reads {size}")
        inputs = views(self.static, host.layout)
        if fill is not None:
            fill(host, inputs.input_ids)
        graph.replay()
        return hidden[:len(batch)], host, inputs
