"""The gateway's bounded priority queue, with aging and one line per tenant, on the CPU.

Order: priority class first (lower is more urgent), fair-share start second (the arrival when
none). Aging: a request's effective priority improves by one class every `aging_seconds` it
waits, so low priority never starves. When the queue is full, a request more urgent (by that
aged order) than the last in line takes its place, and the displaced one is refused with 429
as if it had come too late, so a burst of bulk traffic never locks urgent requests out.
Because every waiting entry ages at the same rate, the order is fixed at insertion: the key
priority * aging_seconds + start sorts exactly like the aged priority at any moment.

The batch tier's lines (gateway/batch/) wait behind every online entry whatever their age:
their key starts at BATCH_KEY, past any online key, so aging never lifts one over an online
request, and a full queue displaces them first. The queue counts them (`batch_waiting`), so
the batch runner can tell whether anything online waits.

Each tenant's entries wait in a heap of their own, and the tenants' lines in a heap by their
first entries, so the queue pops in the one global order, and the dispatcher can pass over a
tenant holding its share of the running batch (`peek(skip)`) without scanning that tenant's
entries. Both heaps are indexed (every item knows its place): a client that leaves takes its
entry out at once, O(log n), so the queue holds exactly its live entries, their memory is
freed while the line is blocked, and `max_queue` bounds what it holds.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.serving.inflight import InFlightRequest

RANK_TTL = 0.2  # seconds a ranking of the line serves position queries
BATCH_KEY = 1e12  # batch entries' keys start here: past any online key (class x aging + start)


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
    tenant: str = ""  # whose line it waits in
    batch: bool = False  # a batch tier's line: behind every online entry
    key: float = 0.0
    seq: int = 0  # ties in `key` go to the earlier push
    pos: int = -1  # its index in its tenant's heap
    queued: bool = False

    @property
    def order(self) -> tuple[float, int]:
        return self.key, self.seq


class _Heap:
    """A binary min-heap of items with `order` and `pos` (their index here, kept current), so
    any item can be taken out, or re-placed after its order changed, in O(log n)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __len__(self) -> int:
        return len(self.items)

    def peek(self) -> Any:
        return self.items[0] if self.items else None

    def push(self, item) -> None:
        item.pos = len(self.items)
        self.items.append(item)
        self._up(item.pos)

    def remove(self, item) -> None:
        i, last = item.pos, self.items.pop()
        item.pos = -1
        if last is not item:  # the last item fills the hole, then finds its place
            self.items[i], last.pos = last, i
            self.fix(i)

    def fix(self, i: int) -> None:
        self._down(self._up(i))

    def _up(self, i: int) -> int:
        items = self.items
        while i > 0 and items[i].order < items[(i - 1) // 2].order:
            self._swap(i, (i - 1) // 2)
            i = (i - 1) // 2
        return i

    def _down(self, i: int) -> None:
        items, n = self.items, len(self.items)
        while (child := 2 * i + 1) < n:
            if child + 1 < n and items[child + 1].order < items[child].order:
                child += 1
            if items[i].order <= items[child].order:
                return
            self._swap(i, child)
            i = child

    def _swap(self, i: int, j: int) -> None:
        items = self.items
        items[i], items[j] = items[j], items[i]
        items[i].pos, items[j].pos = i, j


class _Line:
    """One tenant's waiting entries; ordered among tenants by its first entry."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.entries = _Heap()
        self.pos = -1

    @property
    def order(self) -> tuple[float, int]:
        return self.entries.items[0].order


class RequestQueue:
    def __init__(self, max_size: int, aging_seconds: float = 30.0):
        self.max_size = max_size
        self.aging_seconds = aging_seconds
        self._lines: dict[str, _Line] = {}  # tenant -> its waiting entries
        self._heads = _Heap()  # the lines, by their first entries
        self._count = itertools.count()
        self._size = 0
        self.batch_waiting = 0  # batch entries in line
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
        if entry.batch:
            entry.key = BATCH_KEY + start
        entry.seq = next(self._count)
        displaced = None
        if self._size >= self.max_size:
            last = max(self.waiting(), key=lambda e: e.order, default=None)
            if last is None or entry.key >= last.key:
                raise QueueFull(self.retry_after())
            self.remove(last)
            displaced = last
        line = self._lines.get(entry.tenant)
        if line is None:
            line = self._lines[entry.tenant] = _Line(entry.tenant)
            line.entries.push(entry)
            self._heads.push(line)
        else:
            line.entries.push(entry)
            if entry.pos == 0:  # the tenant's new first entry: its line moves up
                self._heads.fix(line.pos)
        entry.queued = True
        self._size += 1
        self.batch_waiting += entry.batch
        return displaced

    def peek(self, skip: Collection[str] = ()) -> QueueEntry | None:
        """The first entry in line, passing over the lines of the tenants in `skip` (their
        entries keep their places): O(len(skip) log tenants)."""
        held = []
        while (line := self._heads.peek()) is not None and line.tenant in skip:
            self._heads.remove(line)
            held.append(line)
        for passed in held:
            self._heads.push(passed)
        return line.entries.peek() if line is not None else None

    def pop(self, entry: QueueEntry | None = None) -> QueueEntry:
        """Take `entry` (by default the first in line) for a worker."""
        entry = entry if entry is not None else self.peek()
        if entry is None or not self.remove(entry):
            raise IndexError("pop from an empty queue")
        self._note_drain()
        return entry

    def remove(self, entry: QueueEntry) -> bool:
        """Take a waiting entry out of line now; False if it was not in line."""
        if not entry.queued:
            return False
        line = self._lines[entry.tenant]
        was_first = entry.pos == 0
        line.entries.remove(entry)
        if not line.entries:
            self._heads.remove(line)
            del self._lines[entry.tenant]
        elif was_first:
            self._heads.fix(line.pos)
        entry.queued = False
        self._size -= 1
        self.batch_waiting -= entry.batch
        self._ranks.pop(entry, None)  # a stale ranking must not keep it alive either
        return True

    @property
    def online_waiting(self) -> int:
        """Entries in line that are not batch lines."""
        return self._size - self.batch_waiting

    def __contains__(self, entry: QueueEntry) -> bool:
        return entry.queued

    def waiting(self) -> list[QueueEntry]:
        """Entries still in line, in no particular order."""
        return [e for line in self._lines.values() for e in line.entries.items]

    def position(self, entry: QueueEntry) -> int | None:
        """0-based place in line (how many entries will leave before it), from a ranking of
        the whole line that is at most RANK_TTL seconds old; None for an entry newer than it.
        Every WebSocket client polls its position: one sort shared by all of them keeps the
        cost O(n log n) per RANK_TTL instead of a scan per client (O(n^2))."""
        now = time.monotonic()
        if now - self._ranked_at > RANK_TTL:
            line = sorted(self.waiting(), key=lambda e: e.order)
            self._ranks = {e: i for i, e in enumerate(line)}
            self._ranked_at = now
        return self._ranks.get(entry)

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
