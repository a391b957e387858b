"""Block pool and KV manager bookkeeping: exact block ids, reference counts, free order."""
import pytest

from contract.sampling_params import SamplingParams
from runtime.kv.block_pool import BlockPool
from runtime.kv.manager import KVCacheManager
from runtime.scheduling.request import Request


def make_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=4))


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [5]


def test_free_appends_in_given_order_and_counts_references():
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.touch(a[1])  # a second holder
    pool.free(list(reversed(a)))
    assert a[1].ref_cnt == 1
    assert pool.free_queue.block_ids() == [3, 2, 0]
    pool.free([a[1]])
    assert pool.free_queue.block_ids() == [3, 2, 0, 1]


def test_double_free_and_overallocation_raise():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_touch_removes_a_free_block_from_the_middle_in_place():
    pool = BlockPool(5)
    pool.touch(pool.blocks[2])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert [b.block_id for b in pool.allocate(4)] == [0, 1, 3, 4]


def test_manager_allocates_blocks_as_tokens_grow():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = make_request("a", 5)
    assert kv.allocate_slots(r, 5)
    assert kv.block_ids("a") == [0, 1]
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3)  # positions 5..7 fit in block 1
    assert kv.block_ids("a") == [0, 1]
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1)
    assert kv.block_ids("a") == [0, 1, 2]


def test_manager_refusal_changes_nothing_and_free_returns_tail_first():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    r = make_request("a", 4)
    assert kv.allocate_slots(r, 4)
    other = make_request("b", 4)
    assert not kv.allocate_slots(other, 4)
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [2, 1, 0]
