"""What a decode step costs by its shape, measured: the speculation governor's own table.

A decode-only step is keyed by (sequences, rows, draft depth): B requests decoding one token
each plus the proposals verified after them (rows - B), and for a model drafter the number of
draft forwards it ran (the longest proposal; n-gram lookups have depth 0). The value is the
median of the last few steps of that shape, in seconds, as the engine timed them from plan to
processed output, so a speculating step's price includes its proposals (n-gram lookups in the
plan, a drafter's forwards in the runner), its verification rows (whatever kernel path k + 1
rows take) and the rejection bookkeeping. A median, not a mean: one step that lost its core
to a neighbour must not switch speculation off.

Steps that carry prefill are not recorded: their cost is the prompt's, not the decode's.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (runtime.scheduling imports this module)
    from runtime.scheduling.output import SchedulerOutput


WINDOW = 8  # recent steps per shape whose median prices it
MIN_SAMPLES = 2  # steps of a shape before its median is trusted (one may be an outlier)

StepKey = tuple[int, int, int]  # (sequences, rows, draft depth)


def decode_step_key(out: SchedulerOutput, model_drafter: bool) -> StepKey | None:
    """The shape of a step of decodes only (with any proposals), or None for a step that
    carries prefill or nothing."""
    if not out.scheduled:
        return None
    rows = depth = 0
    for s in out.scheduled:
        if s.num_new_tokens - s.num_spec != 1:
            return None
        rows += s.num_new_tokens
        depth = max(depth, s.num_spec)
    return len(out.scheduled), rows, depth if model_drafter else 0


class StepTimes:
    """Recent seconds of decode steps by shape (see the module docstring)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES):
        if window < min_samples or min_samples < 1:
            raise ValueError(f"need 1 <= min_samples <= window, not {min_samples}, {window}")
        self.window = window
        self.min_samples = min_samples
        self._seconds: dict[StepKey, deque[float]] = {}
        self._observed: dict[StepKey, int] = {}  # steps seen of each shape (never forgotten)

    def observe(self, key: StepKey, seconds: float) -> None:
        if seconds <= 0.0:
            return
        self._seconds.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._observed[key] = self._observed.get(key, 0) + 1

    def seconds(self, key: StepKey) -> float | None:
        """The median of the shape's recent steps; None until it has `min_samples`."""
        recent = self._seconds.get(key)
        if recent is None or len(recent) < self.min_samples:
            return None
        return statistics.median(recent)

    def count(self, key: StepKey) -> int:
        return self._observed.get(key, 0)

    def extra_rows(self, batch: int) -> list[tuple[int, float]]:
        """(rows beyond the batch, median seconds) of every measured shape of `batch`
        requests that verified proposals."""
        out = []
        for key in self._seconds:
            seconds = self.seconds(key)
            if key[0] == batch and key[1] > batch and seconds is not None:
                out.append((key[1] - batch, seconds))
        return out


@dataclass(frozen=True)
class ExtraCost:
    """Seconds that verifying x proposals adds to a plain step: F + c x, F what verifying at
    all adds (another kernel path, the drafter's call, the bookkeeping), c each verified row.
    Measured at a single row count x1 only, the cost is taken as fixed below x1 and
    proportional above it, the dearer reading on each side: an unmeasured draft length is
    never priced below what was seen."""

    fixed: float
    per_row: float = 0.0
    single: int = 0  # the one row count measured (0: fitted over several)

    def seconds(self, extra: int) -> float:
        if extra <= 0:
            return 0.0
        if self.single:
            return self.fixed * max(1.0, extra / self.single)
        return self.fixed + self.per_row * extra


def fit_extra_cost(points: list[tuple[int, float]]) -> ExtraCost | None:
    """The least-squares F, c >= 0 over `points` of (rows beyond the batch, extra seconds);
    None without points."""
    if not points:
        return None
    xs = [float(x) for x, _ in points]
    ys = [max(0.0, y) for _, y in points]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    if len(set(xs)) == 1:
        return ExtraCost(sy / n, single=int(xs[0]))
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    c = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    f = (sy - c * sx) / n
    if c < 0.0:
        return ExtraCost(sy / n)
    if f < 0.0:
        return ExtraCost(0.0, sxy / sxx)
    return ExtraCost(f, c)
