"""Block hashes and the table of cached blocks. Bookkeeping only: no tensors.

Blocks are found by their chained hash (contract/block_hashing.py). Cached blocks also remember
their tokens, and a lookup compares them, so even a hash collision cannot serve the wrong KV.

The table is the one place blocks become cached and stop being cached, so it also keeps the
KV event log (runtime/kv/events.py) a gateway routes by.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.kv.block_pool import KVBlock
from runtime.kv.events import KvEventLog


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the pool or the disk tier
    disk_hits: int = 0  # of `hits`, tokens read back from disk
    evictions: int = 0  # cached blocks dropped from the pool


class CachedBlockTable:
    """hash -> block for every full block whose KV is resident in the pool."""

    def __init__(self, event_limit: int = 8192) -> None:
        self._by_hash: dict[bytes, KVBlock] = {}
        self._tokens: dict[int, tuple[int, ...]] = {}  # block id -> its token ids
        self.events = KvEventLog(self.hashes, event_limit)

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._by_hash.get(block_hash)
        if block is None or self._tokens.get(block.block_id) != token_ids:
            return None  # a miss, or a collision caught by the token check
        return block

    def insert(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a freshly filled block; False if an equal block is already cached (the
        request keeps its own copy, so block tables stay append-only)."""
        if block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        self._tokens[block.block_id] = token_ids
        self.events.stored(block_hash)
        return True

    def remove(self, block: KVBlock) -> tuple[int, ...] | None:
        """Forget an evicted block; returns its tokens."""
        if block.block_hash is not None and self._by_hash.get(block.block_hash) is block:
            del self._by_hash[block.block_hash]
            self.events.removed(block.block_hash)
        return self._tokens.pop(block.block_id, None)

    def hashes(self) -> list[bytes]:
        """The hash of every resident cached block."""
        return list(self._by_hash)

    def entries(self) -> list[tuple[KVBlock, bytes, tuple[int, ...]]]:
        """Every resident cached block with its hash and tokens."""
        return [(b, h, self._tokens[b.block_id]) for h, b in self._by_hash.items()]
