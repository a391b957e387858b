"""KV cache manager: gives each request the blocks its tokens need, reusing cached prefixes.

Bookkeeping only. The scheduler asks `match_prefix(request)` when it first looks at a waiting
request, then `allocate_slots(request, n, hit)` before it schedules n new tokens; a False
answer leaves everything unchanged. Blocks that become full are registered in the prefix
cache by `cache_full_blocks`. Evicted cached blocks are queued for the disk tier, and disk hits
are queued for loading; the model runner performs both copies before the next forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.block_pool import BlockPool, KVBlock
from runtime.prefix_cache import CachedBlockTable, PrefixCacheStats, block_hashes, root_hash
from runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)  # resident in the pool
    disk_hashes: list[bytes] = field(default_factory=list)  # continue the chain on disk

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.disk_hashes)


@dataclass
class KVTransfers:
    """Copies the runner makes before the forward: saves first, then loads."""

    saves: list[tuple[int, bytes, tuple[int, ...]]] = field(default_factory=list)
    loads: list[tuple[int, object]] = field(default_factory=list)  # (block id, KV payload)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 model_id: str = "model", disk=None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.disk = disk if enable_prefix_caching else None
        self.cached = CachedBlockTable()
        self.stats = PrefixCacheStats()
        self.transfers = KVTransfers()
        self.pool.on_evict = self._on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix lookup ------------------------------------------------------------------
    def _hashes(self, request: Request, upto_tokens: int) -> list[bytes]:
        if request.block_hash_root is None:
            request.block_hash_root = root_hash(self.model_id, request.cache_salt)
        n = upto_tokens // self.block_size
        if len(request.block_hashes) < n:
            request.block_hashes = block_hashes(request.block_hash_root,
                                                request.token_slice(0, n * self.block_size),
                                                self.block_size, request.block_hashes)
        return request.block_hashes[:n]

    def block_hashes_upto(self, request: Request, num_tokens: int) -> list[bytes]:
        """Chained hashes of the request's full blocks within its first `num_tokens`."""
        return self._hashes(request, num_tokens)

    def match_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks that starts the request's tokens. At least the
        last token is always left to compute (its logits are needed). Changes nothing."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
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
                       hit: PrefixHit | None = None) -> bool:
        """Give the request room for `num_new_tokens` more tokens, after the prefix `hit` if
        it has no blocks yet. False (and no change at all) when the pool is short."""
        is_first = not request.blocks
        hit = hit if hit is not None and is_first else PrefixHit()
        computed = request.num_computed_tokens + hit.num_blocks * self.block_size
        needed = self.num_blocks_for(computed + num_new_tokens) - len(request.blocks) \
            - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)  # leave the free queue
        if needed > self.pool.num_free_blocks - revived:
            return False
        for block in hit.blocks:
            self.pool.touch(block)
        new_blocks = self.pool.allocate(max(0, needed))
        request.blocks.extend(hit.blocks)
        loaded = self._load_from_disk(request, hit.disk_hashes, new_blocks)
        request.blocks.extend(new_blocks)
        if is_first:
            self._count_hit(request, len(hit.blocks) + loaded)
        return True

    def _load_from_disk(self, request: Request, hashes: list[bytes],
                        new_blocks: list[KVBlock]) -> int:
        """Read disk hits into the first new blocks; stop at the first that fails."""
        bs, start = self.block_size, len(request.blocks)
        loaded = 0
        for h, block in zip(hashes, new_blocks):
            i = start + loaded
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            kv = self.disk.load(h, tokens)
            if kv is None:
                break
            self.transfers.loads.append((block.block_id, kv))
            self.cached.insert(block, h, tokens)
            loaded += 1
        self.stats.disk_hits += loaded * bs
        return loaded

    def _count_hit(self, request: Request, num_blocks: int) -> None:
        num_cached = num_blocks * self.block_size
        request.num_computed_tokens += num_cached
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_cached
        if request.num_preemptions == 0:  # billing counts the first admission only
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)

    def trim(self, request: Request) -> None:
        """Free blocks past the request's computed tokens (rejected proposals' room)."""
        keep = max(self.num_blocks_for(request.num_computed_tokens), request.num_hashed_blocks)
        if len(request.blocks) > keep:
            extra = request.blocks[keep:]
            request.blocks = request.blocks[:keep]
            self.pool.free(list(reversed(extra)))

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (see BlockPool.free)."""
        self.pool.free(list(reversed(request.blocks)))
        request.blocks = []
        request.num_hashed_blocks = 0

    # ---- caching after compute ----------------------------------------------------------
    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks whose every slot now holds computed KV."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes(request, request.num_computed_tokens)
        for i in range(request.num_hashed_blocks, len(hashes)):
            block = request.blocks[i]
            if block.block_hash is None:
                self.cached.insert(block, hashes[i],
                                   tuple(request.token_slice(i * bs, (i + 1) * bs)))
        request.num_hashed_blocks = max(request.num_hashed_blocks, len(hashes))

    def _on_evict(self, block: KVBlock) -> None:
        tokens = self.cached.remove(block)
        self.stats.evictions += 1
        if self.disk is not None and tokens is not None:
            self.transfers.saves.append((block.block_id, block.block_hash, tokens))

    def persist_all(self) -> KVTransfers:
        """Saves for every resident cached block, so the disk tier survives a restart."""
        if self.disk is None:
            return KVTransfers()
        return KVTransfers(saves=[(b.block_id, h, t) for b, h, t in self.cached.entries()])

    def take_transfers(self) -> KVTransfers:
        transfers, self.transfers = self.transfers, KVTransfers()
        return transfers

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no request holds a block)."""
        if self.pool.num_used_blocks:
            return False
        for block in self.pool.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
