"""The gateway's bounded priority queue, with aging, on the CPU.

Order: priority class first (lower is more urgent), arrival second. Aging: a request's
effective priority improves by one class every `aging_seconds` it waits, so low priority never
starves. When the queue is full, a request more urgent (by that aged order) than the last in
line takes its place, and the displaced one is refused with 429 as if it had come too late,
so a burst of bulk traffic never locks urgent requests out. Because every waiting entry ages at
the same rate, the order is fixed at insertion:
the key priority * aging_seconds + arrival sorts exactly like the aged priority at any moment,
so a plain heap serves (O(log n) push and pop, O(1) lazy removal).
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.serving.inflight import InFlightRequest

RANK_TTL = 0.2  # seconds a ranking of the line serves position queries


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


@dataclass(eq=False)
class QueueEntry:
    request_id: str
    priority: int
    payload: InFlightRequest  # what waits
    arrival: float = field(default_factory=time.monotonic)
    virtual_start: float | None = None  # fair-share start time; None: the arrival
    key: float = 0.0
    removed: bool = False  # left the line before its turn (its client went away)
    queued: bool = False


class RequestQueue:
    def __init__(self, max_size: int, aging_seconds: float = 30.0):
        self.max_size = max_size
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[float, int, QueueEntry]] = []
        self._count = itertools.count()
        self._size = 0
        self._drain_times: list[float] = []  # recent dequeue times, for Retry-After
        self._ranks: dict[QueueEntry, int] = {}  # see position()
        self._ranked_at = -math.inf

    def __len__(self) -> int:
        return self._size

    def push(self, entry: QueueEntry) -> QueueEntry | None:
        """Queue an entry; when full, displace (and return) the last in line if the new
        entry comes before it, else raise QueueFull."""
        start = entry.arrival if entry.virtual_start is None else entry.virtual_start
        entry.key = entry.priority * self.aging_seconds + start
        displaced = None
        if self._size >= self.max_size:
            last = max(self.waiting(), key=lambda e: e.key, default=None)
            if last is None or entry.key >= last.key:
                raise QueueFull(self.retry_after())
            self.remove(last)
            displaced = last
        heapq.heappush(self._heap, (entry.key, next(self._count), entry))
        entry.queued = True
        self._size += 1
        return displaced

    def peek(self) -> QueueEntry | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> QueueEntry:
        self._drop_removed()
        entry = heapq.heappop(self._heap)[2]
        entry.queued = False
        self._size -= 1
        self._note_drain()
        return entry

    def remove(self, entry: QueueEntry) -> bool:
        """Drop a waiting entry (its client left); False if it was already dequeued."""
        if entry.removed or not entry.queued:
            return False
        entry.removed = True
        entry.queued = False
        self._size -= 1
        return True

    def __contains__(self, entry: QueueEntry) -> bool:
        return entry.queued

    def waiting(self) -> list[QueueEntry]:
        """Entries still in line, in no particular order."""
        return [e for _, _, e in self._heap if e.queued]

    def position(self, entry: QueueEntry) -> int | None:
        """0-based place in line (how many entries will leave before it), from a ranking of
        the whole line that is at most RANK_TTL seconds old; None for an entry newer than it.
        Every WebSocket client polls its position: one sort shared by all of them keeps the
        cost O(n log n) per RANK_TTL instead of a scan per client (O(n^2))."""
        now = time.monotonic()
        if now - self._ranked_at > RANK_TTL:
            line = sorted(self.waiting(), key=lambda e: e.key)
            self._ranks = {e: i for i, e in enumerate(line)}
            self._ranked_at = now
        return self._ranks.get(entry)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2].removed:
            heapq.heappop(self._heap)

    # ---- Retry-After from the drain rate ------------------------------------------------
    def _note_drain(self) -> None:
        now = time.monotonic()
        self._drain_times.append(now)
        if len(self._drain_times) > 256:
            del self._drain_times[:128]

    def drain_rate(self, window: float = 30.0) -> float:
        """Requests leaving the queue per second, over the recent window."""
        now = time.monotonic()
        recent = [t for t in self._drain_times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        return len(recent) / max(now - recent[0], 1e-3)

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained by one full queue's worth."""
        rate = self.drain_rate()
        if rate <= 0:
            return 5
        return max(1, min(60, math.ceil(self._size / rate)))
