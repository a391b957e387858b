"""Prefix caching: exact block ids and eviction order, sharing, isolation, the disk tier."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.block_hashing import chain_hash, root_hash
from contract.sampling_params import SamplingParams
from runtime.kv.manager import KVCacheManager
from runtime.scheduling.request import Request

BS = 4


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def admit(kv, r):
    """What the scheduler does for a waiting request that fits whole (it keeps the prompt
    tokens the cache served)."""
    hit = kv.match_prefix(r)
    n = r.num_tokens - hit.num_blocks * BS
    allocation = kv.allocate_slots(r, n, hit)
    assert allocation
    r.num_cached_tokens = min(allocation.num_cached_tokens, r.num_prompt_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return r


def manager(num_blocks=10, disk=None):
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=True, model_id="m", disk=disk)


# ---- bookkeeping -----------------------------------------------------------------------------
def test_hash_chain_depends_on_parent_tokens_and_salt():
    r0, r1 = root_hash("m", None), root_hash("m", "tenant-a")
    assert r0 != r1 != root_hash("other-model", "tenant-a")
    assert chain_hash(r0, [1, 2, 3, 4]) != chain_hash(r1, [1, 2, 3, 4])
    assert chain_hash(r0, [1, 2, 3, 4]) != chain_hash(r0, [1, 2, 3, 5])
    assert chain_hash(r0, [1, 2, 3, 4]) == chain_hash(r0, [1, 2, 3, 4])


def test_hit_reuses_exact_blocks_and_shares_them_by_reference():
    kv = manager()
    a = admit(kv, req("a", range(10)))  # blocks 0,1 full, block 2 partial
    assert kv.block_ids(a.request_id) == [0, 1, 2]
    b = admit(kv, req("b", list(range(8)) + [50, 51, 52]))
    assert kv.block_ids(b.request_id) == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (kv.stats.queries, kv.stats.hits) == (21, 8)


def test_last_token_is_always_computed():
    kv = manager()
    admit(kv, req("a", range(8)))
    b = admit(kv, req("b", range(8)))  # identical: only the first block may hit
    blocks = kv.block_ids(b.request_id)
    assert b.num_cached_tokens == 4 and blocks[0] == 0 and blocks[1] != 1


def test_different_salts_never_share():
    kv = manager()
    admit(kv, req("a", range(12), salt="tenant-a"))
    b = admit(kv, req("b", range(12), salt="tenant-b"))
    assert b.num_cached_tokens == 0
    c = admit(kv, req("c", range(12), salt="tenant-a"))
    assert c.num_cached_tokens == 8


def test_freed_cached_blocks_are_revived_and_evicted_lru_first():
    kv = manager(num_blocks=6)
    a = admit(kv, req("a", range(8)))  # blocks 0,1 (both full)
    kv.free(a.request_id)  # free order: 2..5 never used, then 1, 0 (tail first)
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    b = admit(kv, req("b", list(range(4)) + [9, 9, 9, 9, 9]))  # revives block 0
    assert kv.block_ids(b.request_id) == [0, 2, 3] and b.num_cached_tokens == 4
    assert kv.pool.free_queue.block_ids() == [4, 5, 1]
    c = admit(kv, req("c", [7] * 12))  # needs 3 blocks: 4, 5, then evicts cached block 1
    assert kv.block_ids(c.request_id) == [4, 5, 1]
    assert kv.stats.evictions == 1
    kv.free(b.request_id)
    kv.free(c.request_id)
    d = admit(kv, req("d", range(10)))  # block 0 still cached, its successor was evicted
    assert d.num_cached_tokens == 4 and kv.block_ids(d.request_id)[0] == 0


def test_refusal_changes_nothing():
    kv = manager(num_blocks=3)
    a = admit(kv, req("a", range(8)))
    kv.free(a.request_id)
    before = kv.pool.free_queue.block_ids()
    b = req("b", list(range(8)) + list(range(100, 120)))
    hit = kv.match_prefix(b)
    assert hit.num_blocks == 2
    assert not kv.allocate_slots(b, b.num_tokens - 8, hit)
    assert kv.pool.free_queue.block_ids() == before and kv.block_ids("b") == []
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


# ---- the engine ------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
REPORT = list(range(20, 60))  # a 40-token "document"


def run(engine, rid, prompt, params=GREEDY, salt=None):
    engine.add_request(rid, prompt, params, cache_salt=salt)
    tokens, final = [], None
    while rid in engine.requests:
        for o in engine.step()[0]:
            if o.request_id == rid:
                tokens += o.new_token_ids
                final = o
    return tokens, final


def test_outputs_identical_with_cache_on_and_off(make_tiny_engine):
    on = make_tiny_engine(enable_prefix_caching=True)
    off = make_tiny_engine(enable_prefix_caching=False)
    for q in ([61, 62], [63, 64, 65], [61, 62]):
        got, final = run(on, f"q{q}", REPORT + q)
        assert got == run(off, f"q{q}", REPORT + q)[0]
    assert final.usage.cached_tokens == 40  # the whole document, 10 blocks of 4
    assert on.kv.stats.hits > 0 and off.kv.stats.hits == 0


def test_two_running_requests_share_blocks(make_tiny_engine):
    engine = make_tiny_engine()
    run(engine, "warm", REPORT + [1])
    engine.add_request("a", REPORT + [2], GREEDY)
    engine.add_request("b", REPORT + [3], GREEDY)
    engine.step()
    a, b = engine.kv.block_ids("a"), engine.kv.block_ids("b")
    shared = set(a) & set(b)
    assert len(shared) == 10
    assert all(engine.kv.pool.blocks[i].ref_cnt == 2 for i in shared)


def test_cross_tenant_requests_get_no_cached_tokens(make_tiny_engine):
    engine = make_tiny_engine()
    run(engine, "a", REPORT + [1], salt="tenant-a")
    _, final = run(engine, "b", REPORT + [1], salt="tenant-b")
    assert final.usage.cached_tokens == 0
    _, final = run(engine, "c", REPORT + [2], salt="tenant-a")
    assert final.usage.cached_tokens == 40


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step"]),
                              st.integers(0, 5), st.integers(1, 30)), max_size=40))
def test_random_adds_aborts_and_steps_leak_no_block(make_tiny_engine, ops):
    engine = make_tiny_engine(num_blocks=24, max_num_batched_tokens=16)
    n = 0
    for op, which, length in ops:
        if op == "add":
            prompt = (REPORT[:length] if which % 2 else [which + 3] * length)
            engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=which + 1,
                                                               ignore_eos=True))
            n += 1
        elif op == "abort" and engine.requests:
            engine.abort_request(sorted(engine.requests)[which % len(engine.requests)])
        else:
            engine.step()
        held = sum(len(engine.kv.block_ids(rid)) for rid in engine.requests)
        refs = sum(b.ref_cnt for b in engine.kv.pool.blocks)
        assert refs == held  # every reference belongs to a live request's block table
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_disk_tier_serves_a_hit_after_restart_and_drops_corrupt_files(make_tiny_engine,
                                                                     tmp_path):
    disk_dir = str(tmp_path / "kv")
    first = make_tiny_engine(num_blocks=13, disk_cache_dir=disk_dir)
    expected, _ = run(first, "doc", REPORT + [7])
    run(first, "flush", [5] * 40)  # needs 12 of 13 blocks: most of the document is evicted
    first.disk_cache.flush()
    assert first.disk_cache.stats.writes == 11  # evictions reach the disk during the run
    first.close()  # ... and the blocks still resident are written at shutdown
    assert first.disk_cache.stats.writes > 11

    restarted = make_tiny_engine(num_blocks=13, disk_cache_dir=disk_dir)
    got, final = run(restarted, "doc", REPORT + [7])
    assert got == expected
    assert final.usage.cached_tokens == 40 and restarted.disk_cache.stats.reads == 10

    # corrupt the file of the document's third block: the chain stops there, nothing breaks
    third = restarted.kv.match_prefix(Request("x", REPORT + [7], GREEDY)).blocks[2].block_hash
    restarted.close()
    path = os.path.join(disk_dir, third.hex() + ".kv")
    assert os.path.exists(path)
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"\x00garbage\x00")
    again = make_tiny_engine(num_blocks=13, disk_cache_dir=disk_dir)
    got, final = run(again, "doc2", REPORT + [7])
    assert got == expected
    assert final.usage.cached_tokens == 8
    assert again.disk_cache.stats.corrupt == 1 and not os.path.exists(path)


def test_unwritable_disk_folder_degrades_to_misses(make_tiny_engine, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    engine = make_tiny_engine(num_blocks=13, disk_cache_dir=str(blocker / "kv"))
    got, final = run(engine, "a", REPORT + [1])
    assert len(got) == 8 and final.finish_reason == "length"


@pytest.mark.model
def test_smollm_greedy_identical_with_cache_on_and_off(smollm_checkpoint):
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    tok = smollm_checkpoint.tokenizer
    doc = "The prefix cache stores key and value tensors for blocks of sixteen tokens. " * 6
    prompts = [tok.encode(doc + q) for q in (" Summarise.", " What is stored?", " Summarise.")]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    # the float path, and the int8 kernel at every step: a cache hit shortens a prompt's step,
    # which under the crossover could move it from the float copy to the kernel (both exact
    # in themselves, not equal to each other)
    for quant in ({"quantization": "none"}, {"quantization": "int8", "quant_max_rows": 10_000}):
        outs = {}
        for flag in (True, False):
            engine = LLMEngine(smollm_checkpoint, EngineConfig(
                kv_cache_bytes=64 << 20, enable_prefix_caching=flag, **quant))
            outs[flag] = [engine.generate([p], params)[0] for p in prompts]
        assert outs[True] == outs[False], quant


def test_concurrent_requests_wait_for_a_prefix_being_computed(make_tiny_engine):
    """Cold cache, simultaneous arrivals: later requests wait for the first one's prefill
    instead of recomputing the same document, then hit all of it."""
    engine = make_tiny_engine(max_num_batched_tokens=64)  # room for q0 and part of q1
    for i in range(4):
        engine.add_request(f"q{i}", REPORT + [61 + i], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            if o.finished:
                finals[o.request_id] = o
    assert finals["q0"].usage.cached_tokens == 0
    assert [finals[f"q{i}"].usage.cached_tokens for i in (1, 2, 3)] == [40, 40, 40]
