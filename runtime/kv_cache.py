"""KV cache manager: gives each request the blocks its tokens need. Bookkeeping only.

The scheduler asks `allocate_slots(request, n)` before it schedules n new tokens; a False
answer leaves everything unchanged, and the scheduler preempts someone and asks again.
"""
from __future__ import annotations

from runtime.block_pool import BlockPool
from runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.blocks))

    def can_allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks_needed(request, num_new_tokens))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Extend the request's blocks to hold `num_new_tokens` more tokens; False if no room."""
        needed = self.num_new_blocks_needed(request, num_new_tokens)
        if not self.pool.can_allocate(needed):
            return False
        request.blocks.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (see BlockPool.free)."""
        self.pool.free(list(reversed(request.blocks)))
        request.blocks = []
