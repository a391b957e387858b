"""KV block bookkeeping: reference counts and an O(1) free list. No tensors live here.

Invariants:
- a block is either in the free queue (ref_cnt == 0) or held by at least one request;
- the free queue's order is the eviction order (prefix caching reuses the least recently
  freed block last), and every queue operation is O(1) through a doubly linked list;
- the pool hands out ids 0 .. num_blocks - 1 only: the page just past them
  (`padding_block_id`) is the model runner's, where the padding rows of a CUDA-graph batch
  write their K/V and read, so no request's KV is ever touched by them.
"""
from __future__ import annotations

from collections.abc import Callable


def padding_block_id(num_blocks: int) -> int:
    """The page a pool of `num_blocks` blocks never hands out: the runner allocates it beside
    the pool's pages for padding rows (runtime/execution/cuda_graphs.py)."""
    return num_blocks


class KVBlock:
    """One fixed-size block of KV slots; `block_hash` is set once the block is full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: popleft, append and remove in O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (first out first); for tests and stats."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All KV blocks of one worker. Paired verbs: `can_allocate` / `allocate`, `free`."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # hook for the prefix cache: called with a block about to be reused while still cached
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def padding_block_id(self) -> int:
        return padding_block_id(self.num_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_cnt 1."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block)
            block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a (possibly free but cached) block."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free queue in order.

        Callers pass a request's blocks tail first, so a request's last blocks are evicted
        before its first ones (a prefix is worth more than a suffix).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
