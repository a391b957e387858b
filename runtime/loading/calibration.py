"""Where the int8 kernel stops paying: measured per weight shape, cached on disk.

Only int8 per-row weights (a float checkpoint quantized on request) keep a float copy and a
crossover; a file's block weights run their kernel at every step size (runtime/models/
linear.py) and are not measured.

For each distinct (format, N, K) the calibration times the quantized matmul against float32
`F.linear` at growing row counts and keeps the largest count at which the quantized one is
still faster; above it the float copy runs (runtime/models/linear.py). Timings depend on the CPU,
the torch build and the thread count, so those name the cache entry; a start with a warm cache
measures nothing. The measurement takes a few seconds for a 135M model on 2 cores. A
measurement made while other work held the cores (a load average above their number) is
used for this start and kept apart, as provisional: a busy minute must not decide every later
start, but a later start on a busy machine takes it instead of measuring as badly again, and
the first quiet start replaces it (`Calibration.save`).

Each timed call starts with the weight out of the CPU's caches, as in a forward pass, where
every other layer's weights pass through them between two uses of one: timed hot, a small
float matrix (576x576, 1.3 MB) beat its int8 copy at one row, but in the model it took 154 us a
call against 84 us for int8, which reads a quarter of the bytes from memory.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F

import kernels
from runtime.loading.quantization import BlockWeight, Int8Weight

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# a kernel that wins at every size tried runs at every size (the 4-bit kernel beat float32
# `F.linear` up to 512-row prefill chunks: 263 against 170 GFLOP/s, docs/perf.md)
EVERY_SIZE = 1 << 30
FORMAT_VERSION = 5  # 2: cold caches; 3: keyed by the int8 kernel; 4: C int4; 5: to 512 rows
EVICT_BYTES = 64 << 20  # more than any last-level cache of these machines
# a ratio's first pairs decide when all are this far from 1 (faster by a quarter or more,
# or slower): on SmolLM2 most row counts are, which cut a cold start's calibration by about half
CLEAR_PAIRS, CLEAR_RATIO = 3, 1.25
# the folder the weight cache of earlier versions shared: the table found there stays valid
DEFAULT_DIR = os.path.join("~", ".cache", "inferstack", "weights")
log = logging.getLogger(__name__)


def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """The explicit folder, else $INFERSTACK_CACHE_DIR, else ~/.cache/inferstack/weights."""
    return os.path.expanduser(cache_dir or os.environ.get("INFERSTACK_CACHE_DIR") or DEFAULT_DIR)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(kind: str, shape: tuple[int, int], prefix: str | None = None) -> str:
    """CPU, torch build, threads, format, shape and the kernel that runs it (the compiled
    decode ops or torch's, kernels.int8_kernel): a change in any of them measures afresh.
    `prefix`: `key_prefix(kind)` computed before (it hashes the kernels' sources)."""
    return f"{prefix or key_prefix(kind)}|{shape[0]}x{shape[1]}"


def key_prefix(kind: str) -> str:
    """Everything in a key but the shape."""
    kernel = kernels.int8_kernel(torch.float32) if kind in ("int8", "int4", "int8-block") \
        else "torch"
    return (f"v{FORMAT_VERSION}|{_cpu_name()}|{torch.__version__}|"
            f"{torch.backends.cpu.get_cpu_capability()}|threads={torch.get_num_threads()}|"
            f"{kind}/{kernel}")


class ColdCache:
    """Reads a buffer larger than the last-level cache, so the next call finds no weight
    there (its first call allocates the buffer)."""

    def __init__(self, nbytes: int = EVICT_BYTES):
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.buffer is None:
            self.buffer = torch.ones(self.nbytes // 4)
        self.buffer.sum()


def _seconds(fn, evict: ColdCache) -> float:
    evict()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def quant_to_dense_ratio(packed: Int8Weight | BlockWeight, weight: torch.Tensor, rows: int,
                         repeats: int = 7, evict: ColdCache | None = None) -> float:
    """Median over pairs of (quantized time / float time), each from cold caches, the two
    run back to back so that a neighbour's burst slows both of a pair alike instead of
    deciding the comparison. The first `CLEAR_PAIRS` pairs decide alone when every one of
    them is clearly on one side (`CLEAR_RATIO`): the median of more would say the same, and
    each pair costs two evictions of the caches, most of a cold start's calibration."""
    evict = evict or ColdCache()
    x = torch.randn(rows, weight.shape[1])
    packed.matmul(x), F.linear(x, weight)  # warm: first calls allocate and fault pages in
    ratios: list[float] = []
    for _ in range(repeats):
        ratios.append(_seconds(lambda: packed.matmul(x), evict)
                      / _seconds(lambda: F.linear(x, weight), evict))
        if len(ratios) == CLEAR_PAIRS and (max(ratios) * CLEAR_RATIO < 1
                                           or min(ratios) > CLEAR_RATIO):
            break
    ratios.sort()
    return ratios[len(ratios) // 2]


def measure(packed: Int8Weight | BlockWeight, weight: torch.Tensor,
            ratio=quant_to_dense_ratio) -> int:
    """The largest row count in ROWS at which `packed` beats float32, 0 if none, EVERY_SIZE if
    it wins at all of them. The counts are tried in order and the search stops at the first
    loss (the gap only widens) that a second measurement confirms. One noisy loss must not
    stop it early: with the C kernels the fused decode layer runs only up to the smallest
    crossover of all shapes, so a single shape measured at 16 instead of 128 (seen with
    another process starting) halved the throughput at 32 and more streams."""
    best, evict = 0, ColdCache()
    for rows in ROWS:
        if ratio(packed, weight, rows, evict=evict) >= 1.0 \
                and ratio(packed, weight, rows, evict=evict) >= 1.0:
            return best
        best = rows
    return EVERY_SIZE


def machine_busy() -> bool:
    """Whether the last minute's load exceeded the cores: more runnable work than cores, so
    our timings shared them (our own start-up counts too, hence not a lower bar)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load > (os.cpu_count() or 1)


class Calibration:
    """The crossover table, loaded from and saved to one JSON file in `cache_dir`, and the
    provisional one beside it: what a busy machine measured (see `save`)."""

    def __init__(self, cache_dir: str | None):
        self.path = os.path.join(cache_dir, "linear-crossover.json") if cache_dir else None
        self.busy_path = os.path.join(cache_dir, "linear-crossover-busy.json") if cache_dir \
            else None
        self.table: dict[str, int] = _load(self.path)
        self.provisional: dict[str, int] = _load(self.busy_path)
        self.fresh: dict[str, int] = {}  # measured this start
        self.measured = 0  # shapes measured this start (0: all came from the tables)
        self.used_provisional = 0  # lookups answered by the provisional table
        self.seconds = 0.0
        self.saved_as = ""  # "settled", "provisional" or "" (nothing saved), after `save`
        self._busy: bool | None = None  # the machine's state, asked once, at the first miss
        self._prefixes: dict[tuple[str, int], str] = {}

    def max_quant_rows(self, kind: str, weight: torch.Tensor,
                       packed: Int8Weight | BlockWeight) -> int:
        prefix = self._prefixes.get((kind, torch.get_num_threads()))
        if prefix is None:
            prefix = self._prefixes[kind, torch.get_num_threads()] = key_prefix(kind)
        key = cache_key(kind, tuple(weight.shape), prefix)  # type: ignore[arg-type]
        if key in self.table:
            return self.table[key]
        if key not in self.fresh:
            if key in self.provisional and self._machine_busy():
                self.used_provisional += 1  # measured busy before; a busy re-run is no better
                return self.provisional[key]
            start = time.perf_counter()
            self.fresh[key] = measure(packed, weight)
            self.seconds += time.perf_counter() - start
            self.measured += 1
        return self.fresh[key]

    def save(self) -> None:
        """Keep what this start measured. Measured on a busy machine, it goes to the
        provisional table: a busy minute must not decide every later start, but a start that
        is busy too uses it rather than measure again, at the start's cost, just as badly
        (seconds per shape, 30 s for SmolLM2 beside a test run); a quiet start measures those
        shapes afresh and settles them."""
        if not self.measured:
            return
        busy = machine_busy()
        if busy:
            written = _store(self.busy_path, {**self.provisional, **self.fresh})
        else:
            self.table.update(self.fresh)
            written = _store(self.path, self.table)
            if written and self.fresh.keys() & self.provisional.keys():
                _store(self.busy_path, {k: v for k, v in self.provisional.items()
                                        if k not in self.fresh})
        self.saved_as = ("provisional" if busy else "settled") if written else ""

    def _machine_busy(self) -> bool:
        if self._busy is None:
            self._busy = machine_busy()
        return self._busy


def _load(path: str | None) -> dict[str, int]:
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        return {str(k): int(v) for k, v in table.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}  # garbled: measure again


def _store(path: str | None, table: dict[str, int]) -> bool:
    """Write `table` to `path` atomically; False where it could not be written."""
    if path is None:
        return False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError as e:  # a read-only cache costs a second at the next start, no more
        log.warning("linear crossover table not saved: %s", e)
        return False
