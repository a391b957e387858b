"""Worker-busy seconds by tier: how much of the GPUs' working time went to online requests and
how much to Batch API lines, and so the utilisation the batch tier added.

Workers report one running total of busy seconds each (`busy_seconds` in their statistics,
sent every step). A worker's busy time between two looks is split between the tiers by the
sequences it had from each, averaged over the two looks; the accounting asks for a look just
before a settlement changes that mix, and every snapshot and scrape takes one, so a split is
exact while the mix holds and off by at most the interval between looks when it changes.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from billing.pricing import TIERS

WINDOW_SECONDS = 60.0  # the recent utilisation's window
KEEP_SAMPLES = 4096  # looks kept for that window (bounded whatever the settlement rate)


@dataclass(frozen=True)
class WorkerMix:
    """One worker at one look: its busy-seconds total and its sequences by tier."""

    index: int
    busy_seconds: float | None  # None: no statistics yet
    batch: int
    total: int

    @property
    def batch_share(self) -> float:
        return min(1.0, self.batch / self.total) if self.total > 0 else 0.0


class TierUsage:
    def __init__(self, clock=time.time):
        self.clock = clock
        self.busy = dict.fromkeys(TIERS, 0.0)  # busy seconds since start, by tier
        self._last: dict[int, tuple[float, float]] = {}  # worker -> (busy total, batch share)
        # (time, online busy, batch busy, worker-seconds) at each look, for recent rates
        self._history: deque[tuple[float, float, float, float]] = deque(maxlen=KEEP_SAMPLES)

    def look(self, workers: Iterable[WorkerMix], worker_seconds: float) -> None:
        """Split what each worker's busy total grew since the last look between the tiers."""
        for w in workers:
            if w.busy_seconds is None:
                continue
            share = w.batch_share
            previous = self._last.get(w.index)
            self._last[w.index] = (w.busy_seconds, share)
            if previous is None:
                continue
            before, share_before = previous
            # a restarted worker counts from 0 again: all of its new total is new
            grown = w.busy_seconds - before if w.busy_seconds >= before else w.busy_seconds
            batch = grown * (share + share_before) / 2
            self.busy["batch"] += batch
            self.busy["online"] += grown - batch
        now = self.clock()
        self._history.append((now, self.busy["online"], self.busy["batch"], worker_seconds))
        while self._history and self._history[0][0] < now - 2 * WINDOW_SECONDS:
            self._history.popleft()

    def forget(self, index: int) -> None:
        """A worker left the pool: its next statistics (a new process) start afresh."""
        self._last.pop(index, None)

    @property
    def batch_share(self) -> float:
        """The share of all busy seconds so far that went to batch lines."""
        total = self.busy["online"] + self.busy["batch"]
        return self.busy["batch"] / total if total > 0 else 0.0

    def recent(self, window: float = WINDOW_SECONDS) -> dict[str, float]:
        """Utilisation by tier over the last `window` seconds: busy seconds of each tier per
        worker-second the pool had. "batch" is the utilisation the tier added."""
        if len(self._history) < 2:
            return dict.fromkeys(TIERS, 0.0)
        newest = self._history[-1]
        oldest = next((h for h in self._history if h[0] >= newest[0] - window),
                      self._history[0])
        span = newest[3] - oldest[3]
        if span <= 0:
            return dict.fromkeys(TIERS, 0.0)
        return {"online": min(1.0, (newest[1] - oldest[1]) / span),
                "batch": min(1.0, (newest[2] - oldest[2]) / span)}


def worker_mixes(workers: Iterable, sequences: Mapping[int, Mapping[str, int]],
                 batch_sequences: Mapping[int, int]) -> list[WorkerMix]:
    """Each worker's look: `sequences` is the in-flight table's sequences per worker and
    tenant (TenantSlots.on), `batch_sequences` the batch lines' per worker."""
    return [WorkerMix(w.index, w.stats.get("busy_seconds"), batch_sequences.get(w.index, 0),
                      sum(sequences.get(w.index, {}).values())) for w in workers]
