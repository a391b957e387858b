"""Shared helpers for the benchmarks in bench/: thread setup, the machine's measured limits
(copy bandwidth, float32 matmul rate, the model's linear layers alone), statistics, a
markdown table and JSON output.

Every limit is the best (minimum-time) of a few repeats: on a noisy shared machine the minimum
is the closest estimate of what the hardware can do, so a bound built from it stays a bound.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from numeric.percentiles import percentile  # noqa: F401  (the one percentile; NaN for none)

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---- setup ------------------------------------------------------------------------------
def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def setup_threads(threads: int | None = None) -> int:
    """Use every core this process may run on (or `threads`); returns the count used."""
    n = threads or num_cores()
    torch.set_num_threads(n)
    return n


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpu": cpu, "cores": num_cores(), "load_avg_1min": load,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


# ---- timing and statistics --------------------------------------------------------------
def best_time(fn: Callable[[], object], reps: int = 3, warmup: int = 1,
              min_total_s: float = 0.0, max_reps: int = 50) -> float:
    """Minimum wall time of `fn()` over `reps` runs (more, up to `max_reps`, until
    `min_total_s` seconds have been spent timing), after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    best, spent, n = float("inf"), 0.0, 0
    while n < reps or (spent < min_total_s and n < max_reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


# ---- machine limits ---------------------------------------------------------------------
def copy_bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """GB/s copied by `clone()` of an `nbytes` float32 tensor (bytes of the tensor per second;
    the memory traffic is twice that: one read and one write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = best_time(partial(dst.copy_, src), reps=reps)
    del src, dst
    return nbytes / t / 1e9


def read_bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """GB/s read by `sum()` over an `nbytes` float32 tensor (what a batch-1 decode step does
    to the weights)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    t = best_time(src.sum, reps=reps)
    del src
    return nbytes / t / 1e9


def matmul_gflops(n: int = 2048, reps: int = 3) -> float:
    """float32 GFLOP/s of an n x n by n x n matmul (2 n^3 flops)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    t = best_time(lambda: torch.matmul(a, b, out=out), reps=reps)
    return 2 * n ** 3 / t / 1e9


@dataclass
class LinearProfile:
    """Measured time of a model's linear layers alone (random inputs, `F.linear` on the real
    weights), as a function of the number of token rows.

    `layers(n)`: all decoder layers' linear weights on n rows; `lm_head(n)`: the output
    projection on n rows (only rows that need logits). Between measured sizes the time is
    interpolated linearly; beyond the largest it is scaled in proportion to n.
    """

    sizes: list[int]
    layer_s: list[float]
    lm_head_s: list[float]
    weight_bytes: int = 0
    flops_per_token: int = 0  # layers only
    lm_head_flops_per_row: int = 0
    meta: dict = field(default_factory=dict)

    @staticmethod
    def _interp(sizes: list[int], times: list[float], n: float) -> float:
        if n <= 0:
            return 0.0
        if n <= sizes[0]:
            return times[0] * n / sizes[0] if sizes[0] > 1 else times[0]
        for (n0, t0), (n1, t1) in zip(zip(sizes, times), zip(sizes[1:], times[1:])):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return times[-1] * n / sizes[-1]

    def layers(self, n: float) -> float:
        return self._interp(self.sizes, self.layer_s, n)

    def lm_head(self, n: float) -> float:
        return self._interp(self.sizes, self.lm_head_s, n)

    def full(self, n: float) -> float:
        """A decode step of n sequences: layers and lm_head on every row."""
        return self.layers(n) + self.lm_head(n)

    def prefill_per_token(self) -> float:
        """Cheapest measured per-token cost of the layers (a large batch of rows)."""
        return min(t / n for n, t in zip(self.sizes, self.layer_s))

    def merged_min(self, other: LinearProfile) -> LinearProfile:
        """Element-wise minimum of two measurements of the same sizes (e.g. before and after
        a benchmark), so a noisy moment does not loosen the bound."""
        assert self.sizes == other.sizes
        spread = max(max(a, b) / min(a, b) for a, b in
                     zip(self.layer_s + self.lm_head_s, other.layer_s + other.lm_head_s))
        return LinearProfile(self.sizes, [min(a, b) for a, b in zip(self.layer_s, other.layer_s)],
                             [min(a, b) for a, b in zip(self.lm_head_s, other.lm_head_s)],
                             self.weight_bytes, self.flops_per_token, self.lm_head_flops_per_row,
                             {"measurements": 2, "max_spread": spread,
                              **{k: v for k, v in self.meta.items() if k == "packed_bytes"}})

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "layers_s": self.layer_s, "lm_head_s": self.lm_head_s,
                "full_s": [a + b for a, b in zip(self.layer_s, self.lm_head_s)],
                "weight_bytes": self.weight_bytes, "layer_flops_per_token": self.flops_per_token,
                "lm_head_flops_per_row": self.lm_head_flops_per_row,
                "prefill_per_token_s": self.prefill_per_token(), **self.meta}


def measure_linear(weights: Iterable[torch.Tensor], lm_head: torch.Tensor,
                   sizes: Sequence[int] = (1, 32, 64, 256), reps: int = 3,
                   min_total_s: float = 0.5, packed: Sequence | None = None,
                   packed_head=None) -> LinearProfile:
    """Time `F.linear` over every weight in `weights` (all layers, [out, in]) and over
    `lm_head`, at each row count in `sizes`; minimum over repeats. With the quantized forms
    (`packed`: one per weight, each with `.matmul(x)`; `packed_head`), each size also times
    them and keeps the faster of the two whole passes: the bound of a quantized model is its
    best kernel at every batch size."""
    if packed is not None:
        return _quantized_profile(weights, lm_head, sizes, reps, min_total_s, packed,
                                  packed_head)
    weights = [w.contiguous() for w in weights]
    lm_head = lm_head.contiguous()
    dtype = lm_head.dtype
    in_dims = sorted({w.shape[1] for w in weights} | {lm_head.shape[1]})
    layer_s, head_s = [], []
    with torch.inference_mode():
        for n in sizes:
            xs = {d: torch.randn(n, d, dtype=dtype) for d in in_dims}

            def run_layers():
                for w in weights:
                    F.linear(xs[w.shape[1]], w)  # noqa: B023 - timed in this iteration only

            def run_head():
                F.linear(xs[lm_head.shape[1]], lm_head)  # noqa: B023 - as above

            layer_s.append(best_time(run_layers, reps=reps, min_total_s=min_total_s))
            head_s.append(best_time(run_head, reps=reps, min_total_s=min_total_s / 4))
    elem = lm_head.element_size()
    return LinearProfile(
        list(sizes), layer_s, head_s,
        weight_bytes=sum(w.numel() for w in weights) * elem + lm_head.numel() * elem,
        flops_per_token=sum(2 * w.numel() for w in weights),
        lm_head_flops_per_row=2 * lm_head.numel())


# ---- output -----------------------------------------------------------------------------
def _quantized_profile(weights, lm_head, sizes, reps, min_total_s, packed,
                       packed_head) -> LinearProfile:
    dense = measure_linear(weights, lm_head, sizes, reps, min_total_s)
    layer_q, head_q = [], []
    in_dims = sorted({w.shape[1] for w in weights} | {lm_head.shape[1]})
    with torch.inference_mode():
        for n in sizes:
            xs = {d: torch.randn(n, d) for d in in_dims}

            def run_layers():
                for w, p in zip(weights, packed):
                    p.matmul(xs[w.shape[1]])  # noqa: B023 - timed in this iteration only

            def run_head():
                packed_head.matmul(xs[lm_head.shape[1]])  # noqa: B023 - as above

            layer_q.append(best_time(run_layers, reps=reps, min_total_s=min_total_s))
            head_q.append(best_time(run_head, reps=reps, min_total_s=min_total_s / 4))
    return LinearProfile(
        list(sizes), [min(a, b) for a, b in zip(dense.layer_s, layer_q)],
        [min(a, b) for a, b in zip(dense.lm_head_s, head_q)], dense.weight_bytes,
        dense.flops_per_token, dense.lm_head_flops_per_row,
        {"float_layers_s": dense.layer_s, "float_lm_head_s": dense.lm_head_s,
         "quant_layers_s": layer_q, "quant_lm_head_s": head_q,
         "packed_bytes": sum(p.nbytes for p in packed) + packed_head.nbytes})


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if x != x:  # NaN
            return "n/a"
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _clean(o):
    """JSON-ready copy: NaN/inf become null, objects with `to_dict` are expanded."""
    if isinstance(o, float):
        return o if o == o and o not in (float("inf"), float("-inf")) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if hasattr(o, "to_dict"):
        return _clean(o.to_dict())
    if isinstance(o, Path):
        return str(o)
    return o


def write_json(path: str | os.PathLike, obj) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")
    return p


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
