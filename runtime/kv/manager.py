"""KV cache manager: gives each request the blocks its tokens need, reusing cached prefixes.

Bookkeeping only. The manager owns every request's block table and block hashes and is the
only place that changes them; it reads requests (tokens, salt, counters) but never writes
them. The scheduler asks `match_prefix(request)` when it first looks at a waiting request,
then `allocate_slots(request, n, hit)` before it schedules n new tokens; None leaves
everything unchanged, and an `Allocation` says how many leading tokens the prefix cache
served, which the scheduler adds to the request's computed tokens. Blocks that become full
are registered in the prefix cache by `cache_full_blocks`. Evicted cached blocks are queued
for the disk tier, and disk hits are queued for loading; the model runner performs both
copies before the next forward.

The cached-block table logs every block it gains and loses (runtime/kv/events.py), bounded by
the pool's size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from contract.block_hashing import block_hashes, root_hash
from runtime.kv.block_pool import BlockPool, KVBlock
from runtime.kv.events import event_limit
from runtime.kv.prefix_cache import CachedBlockTable, PrefixCacheStats
from runtime.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)  # resident in the pool
    disk_hashes: list[bytes] = field(default_factory=list)  # continue the chain on disk

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.disk_hashes)


@dataclass(frozen=True)
class Allocation:
    """A granted allocation: how many leading tokens the prefix cache served (pool or disk);
    nonzero only on a request's first allocation."""

    num_cached_tokens: int = 0


@dataclass(frozen=True)
class KVTransfers:
    """Copies the runner makes before the forward: saves first, then loads."""

    saves: tuple[tuple[int, bytes, tuple[int, ...]], ...] = ()  # (block id, hash, tokens)
    loads: tuple[tuple[int, object], ...] = ()  # (block id, KV payload read from disk)


@dataclass
class RequestKV:
    """What the manager keeps per request."""

    blocks: list[KVBlock] = field(default_factory=list)  # in position order
    hash_root: bytes | None = None  # prefix-cache chain root (model id + salt)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered: int = 0  # leading blocks already registered in the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 model_id: str = "model", disk=None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.disk = disk if enable_prefix_caching else None
        self.cached = CachedBlockTable(event_limit(num_blocks))
        self.stats = PrefixCacheStats()
        self._requests: dict[str, RequestKV] = {}
        self._saves: list[tuple[int, bytes, tuple[int, ...]]] = []
        self._loads: list[tuple[int, object]] = []
        self.pool.on_evict = self._on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty when it holds no block)."""
        held = self._requests.get(request_id)
        return [b.block_id for b in held.blocks] if held is not None else []

    def _held(self, request_id: str) -> RequestKV:
        held = self._requests.get(request_id)
        if held is None:
            held = self._requests[request_id] = RequestKV()
        return held

    # ---- prefix lookup ------------------------------------------------------------------
    def _hashes(self, request: Request, upto_tokens: int) -> list[bytes]:
        held = self._held(request.request_id)
        if held.hash_root is None:
            held.hash_root = root_hash(self.model_id, request.cache_salt)
        # a placeholder (a token still on the device) is never hashed
        n = min(upto_tokens, request.num_known_tokens) // self.block_size
        if len(held.hashes) < n:  # tokens only grow, so known hashes stay valid
            held.hashes = block_hashes(held.hash_root, request.token_slice(0, n * self.block_size),
                                       self.block_size, held.hashes)
        return held.hashes[:n]

    def block_hashes_upto(self, request: Request, num_tokens: int) -> list[bytes]:
        """Chained hashes of the request's full blocks within its first `num_tokens`."""
        return self._hashes(request, num_tokens)

    def match_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks that starts the request's tokens. At least the
        last token is always left to compute (its logits are needed). Takes no block.
        A request gathering prompt logprobs reads nothing: it needs every position's logits
        (vLLM does the same); its full blocks are still cached for others."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return hit
        bs = self.block_size
        for i, h in enumerate(self._hashes(request, request.num_tokens - 1)):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            block = None if hit.disk_hashes else self.cached.get(h, tokens)
            if block is not None:
                hit.blocks.append(block)
            elif self.disk is not None and self.disk.contains(h):
                hit.disk_hashes.append(h)
            else:
                break
        return hit

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> Allocation | None:
        """Give the request room for `num_new_tokens` more tokens, after the prefix `hit` if
        it has no blocks yet. None (and no change at all) when the pool is short."""
        held = self._requests.get(request.request_id)
        num_held = len(held.blocks) if held is not None else 0
        is_first = num_held == 0
        hit = hit if hit is not None and is_first else PrefixHit()
        computed = request.num_computed_tokens + hit.num_blocks * self.block_size
        needed = self.num_blocks_for(computed + num_new_tokens) - num_held - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)  # leave the free queue
        if needed > self.pool.num_free_blocks - revived:
            return None
        held = self._held(request.request_id)
        for block in hit.blocks:
            self.pool.touch(block)
        new_blocks = self.pool.allocate(max(0, needed))
        held.blocks.extend(hit.blocks)
        loaded = self._load_from_disk(request, held, hit.disk_hashes, new_blocks)
        held.blocks.extend(new_blocks)
        if not is_first:
            return Allocation()
        return Allocation(self._count_hit(request, len(hit.blocks) + loaded))

    def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        """Fresh blocks for a request whose KV another worker computed (no prefix lookup);
        their ids, in order. MemoryError when the pool is short."""
        blocks = self.pool.allocate(num_blocks)
        self._held(request_id).blocks.extend(blocks)
        return [b.block_id for b in blocks]

    def _load_from_disk(self, request: Request, held: RequestKV, hashes: list[bytes],
                        new_blocks: list[KVBlock]) -> int:
        """Read disk hits into the first new blocks; stop at the first that fails."""
        bs, start = self.block_size, len(held.blocks)
        loaded = 0
        for h, block in zip(hashes, new_blocks):
            i = start + loaded
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            kv = self.disk.load(h, tokens)
            if kv is None:
                break
            self._loads.append((block.block_id, kv))
            self.cached.insert(block, h, tokens)
            loaded += 1
        self.stats.disk_hits += loaded * bs
        return loaded

    def _count_hit(self, request: Request, num_blocks: int) -> int:
        num_cached = num_blocks * self.block_size
        if self.enable_prefix_caching and not request.needs_prompt_logprobs:  # did not look
            self.stats.queries += request.num_tokens
            self.stats.hits += num_cached
        return num_cached

    def trim(self, request: Request) -> None:
        """Free blocks past the request's computed tokens (rejected proposals' room)."""
        held = self._requests[request.request_id]
        keep = max(self.num_blocks_for(request.num_computed_tokens), held.num_registered)
        if len(held.blocks) > keep:
            extra = held.blocks[keep:]
            held.blocks = held.blocks[:keep]
            self.pool.free(list(reversed(extra)))

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (see BlockPool.free). Its hashes
        are kept: a preempted request comes back with the same tokens."""
        held = self._requests.get(request_id)
        if held is None:
            return
        self.pool.free(list(reversed(held.blocks)))
        held.blocks = []
        held.num_registered = 0

    def remove(self, request_id: str) -> None:
        """The request is gone: free its blocks and forget it."""
        self.free(request_id)
        self._requests.pop(request_id, None)

    # ---- caching after compute ----------------------------------------------------------
    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks whose every slot now holds computed KV."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes(request, request.num_computed_tokens)
        held = self._requests[request.request_id]
        for i in range(held.num_registered, len(hashes)):
            block = held.blocks[i]
            if block.block_hash is None:
                self.cached.insert(block, hashes[i],
                                   tuple(request.token_slice(i * bs, (i + 1) * bs)))
        held.num_registered = max(held.num_registered, len(hashes))

    def _on_evict(self, block: KVBlock) -> None:
        tokens = self.cached.remove(block)
        self.stats.evictions += 1
        if self.disk is not None and tokens is not None:
            self._saves.append((block.block_id, block.block_hash, tokens))

    def persist_all(self) -> KVTransfers:
        """Saves for every resident cached block, so the disk tier survives a restart."""
        if self.disk is None:
            return KVTransfers()
        return KVTransfers(saves=tuple((b.block_id, h, t) for b, h, t in self.cached.entries()))

    def take_transfers(self) -> KVTransfers:
        transfers = KVTransfers(tuple(self._saves), tuple(self._loads))
        self._saves, self._loads = [], []
        return transfers
