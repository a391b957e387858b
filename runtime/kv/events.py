"""KV events: which cached blocks a worker gained and lost, for cache-aware routing.

A gateway keeps an index of the blocks each worker holds (gateway/workers/prefix_index.py) and
routes a request to the worker holding its longest cached prefix. The worker feeds that index
with `KvEvents` frames (contract/frames.py) naming the prefix cache's chained block hashes
(runtime/kv/prefix_cache.py) in hex: a block is "stored" when it enters the cached-block table and
"removed" when it leaves it. Only blocks resident in the KV pool (GPU memory, or CPU memory on
a CPU worker) count as held: a block evicted to the disk tier is removed, and one read back
from disk is stored again. A disk hit costs a read that a fresh prefill on a less busy worker
may beat, and the disk tier can be far larger than the pool, so indexing it would grow every
gateway's index with blocks that are slow to serve.

Between two drains the log keeps each touched hash's latest state only (a hash stored then
removed is reported removed, and the other way round): applying a batch is a set of idempotent
set operations, so a gateway whose view was taken at any moment inside the batch (say from a
snapshot sent when it connected) still ends exactly right. Memory is bounded: past `limit`
touched hashes the log stops recording and the next drain sends a snapshot instead (cleared,
then every held hash), which is never longer than the pool, so a gateway that stops draining
costs at most `limit` entries.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from contract.frames import KvEvents

MIN_EVENT_LIMIT = 1024


def event_limit(num_blocks: int) -> int:
    """The bound for a cache of `num_blocks` blocks: twice the cache, so a snapshot (at most
    the cache) is always smaller than the backlog it replaces."""
    return max(MIN_EVENT_LIMIT, 2 * num_blocks)


class KvEventLog:
    """The stored/removed events of one cached-block table, batched between drains."""

    def __init__(self, held: Callable[[], Iterable[bytes]], limit: int = 8192):
        self._held = held  # every hash resident now, for snapshots
        self.limit = limit
        self._pending: dict[bytes, bool] = {}  # hash -> held now (its latest event)
        self._collapsed = False  # over the limit: the next drain is a snapshot

    def stored(self, block_hash: bytes) -> None:
        self._record(block_hash, True)

    def removed(self, block_hash: bytes) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: bytes, held: bool) -> None:
        if self._collapsed:
            return  # the snapshot the next drain sends will say it
        self._pending[block_hash] = held
        if len(self._pending) > self.limit:
            self._pending.clear()
            self._collapsed = True

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def drain(self) -> KvEvents | None:
        """The batch since the last drain (None when nothing changed), and start a new one."""
        if self._collapsed:
            self._collapsed = False
            return self.snapshot()
        if not self._pending:
            return None
        pending, self._pending = self._pending, {}
        return KvEvents(tuple(h.hex() for h, held in pending.items() if held),
                        tuple(h.hex() for h, held in pending.items() if not held))

    def snapshot(self) -> KvEvents:
        """Everything held now, as a frame that replaces a gateway's view of this worker. The
        pending batch is kept: other gateways still need it."""
        return KvEvents(tuple(h.hex() for h in self._held()), (), cleared=True)
