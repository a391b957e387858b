"""Block hashes and the table of cached blocks. Bookkeeping only: no tensors.

A full block's hash is chained: hash(parent hash, its token ids), and the chain's root is
hash(model id, cache salt). Two requests share a block only if they share the model, the salt
and every token up to the end of that block, so tenants with different salts never share
(and cannot time each other's prompts). Cached blocks also remember their tokens, and a lookup
compares them, so even a hash collision cannot serve the wrong KV.

The table is the one place blocks become cached and stop being cached, so it also keeps the
KV event log (runtime/kv_events.py) a gateway routes by. The hashing functions are pure (no
torch): the gateway imports them to hash a request's prompt exactly as a worker does.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from runtime.block_pool import KVBlock
from runtime.kv_events import KvEventLog


def root_hash(model_id: str, cache_salt: str | None) -> bytes:
    """The chain's root: the model and the namespace (salt) the request belongs to."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model_id.encode())
    h.update(b"\x00salt\x00" + (cache_salt.encode("utf-8", "surrogatepass")
                                if cache_salt is not None else b"\xff"))
    return h.digest()


def chain_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def block_hashes(root: bytes, token_ids: list[int], block_size: int,
                 known: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids`, reusing the `known` leading hashes."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


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
