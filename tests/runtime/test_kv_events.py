"""KV events: blocks stored once full, removed on eviction (to the disk tier too), a view built
from the drains equal to the snapshot at every step, the fake engine's hashes equal to the
model engine's, and the log bounded when nobody drains."""
from __future__ import annotations

from contract.block_hashing import block_hashes, root_hash
from contract.frames import KvEvents, decode_frame, encode_frame
from contract.sampling_params import SamplingParams
from runtime.fake_engine import FakeEngine
from runtime.kv.events import KvEventLog, event_limit

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FOUR = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
DOC = list(range(20, 50))  # 30 tokens: 7 full blocks of 4 and 2 tokens over


def hexes(model_id, salt, tokens, block_size=4):
    return [h.hex() for h in block_hashes(root_hash(model_id, salt), tokens, block_size)]


def finish(engine, on_step=None):
    while engine.has_unfinished_requests():
        engine.step()
        if on_step is not None:
            on_step()


class View:
    """What a gateway keeps of one worker: the set the KV events describe."""

    def __init__(self, frame=None):
        self.held: set[str] = set()
        if frame is not None:
            self.apply(frame)

    def apply(self, frame) -> None:
        if frame is None:
            return
        if frame.cleared:
            self.held = set()
        self.held -= set(frame.removed)
        self.held |= set(frame.stored)


def cached_now(engine) -> set[str]:
    return {h.hex() for h in engine.kv.cached.hashes()}


def test_blocks_are_stored_as_their_chunks_fill(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=12)  # the prompt takes three steps
    engine.add_request("a", DOC, ONE, cache_salt="t1")
    assert engine.drain_kv_events() is None  # nothing is computed before a step
    expected = hexes(engine.model_id, "t1", DOC)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        frame = engine.drain_kv_events()
        assert isinstance(frame, KvEvents) and not frame.removed and not frame.cleared
        seen.append(list(frame.stored))
    assert seen == [expected[:3], expected[3:6], expected[6:]]  # 12, 24, then 30 tokens
    assert engine.drain_kv_events() is None
    assert decode_frame(encode_frame(engine.kv_snapshot())[4:]) == KvEvents(
        tuple(expected), (), True)


def test_eviction_reports_the_blocks_removed(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=12)
    engine.add_request("doc", DOC, FOUR)
    finish(engine)
    doc = set(hexes(engine.model_id, None, DOC))
    assert set(engine.drain_kv_events().stored) == cached_now(engine) >= doc
    before = cached_now(engine)
    engine.add_request("other", [7] * 40, ONE)  # needs 10 of 12 blocks: evicts the document
    finish(engine)
    frame = engine.drain_kv_events()
    assert set(frame.removed) == before - cached_now(engine) and frame.removed
    assert set(frame.stored) == cached_now(engine) - before
    assert engine.kv.stats.evictions == len(frame.removed)


def test_a_view_from_the_drains_equals_the_snapshot_at_every_step(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=20, max_num_batched_tokens=16)
    first = View(engine.kv_snapshot())
    late: list[View] = []

    def check():
        first.apply(frame := engine.drain_kv_events())
        for view in late:
            view.apply(frame)
        snapshot = set(engine.kv_snapshot().stored)
        assert first.held == snapshot == cached_now(engine)
        assert all(view.held == snapshot for view in late)
    for i in range(12):  # shared documents, new tails, aborts: stores and evictions mixed
        prompt = DOC[:8 + 2 * (i % 5)] + [60 + i] * (i % 4 + 1)
        engine.add_request(f"r{i}", prompt, FOUR, cache_salt=f"t{i % 2}")
        engine.step()
        if i == 5:  # a gateway joining mid-run: a snapshot while this step's events wait
            assert engine.kv.cached.events.num_pending > 0
            late.append(View(engine.kv_snapshot()))
        check()
        if i % 3 == 2:
            engine.abort_request(f"r{i - 1}")
    finish(engine, check)
    assert engine.kv.stats.evictions > 0 and late[0].held == first.held


def test_the_disk_tier_does_not_count_as_held(make_tiny_engine, tmp_path):
    engine = make_tiny_engine(num_blocks=13, disk_cache_dir=str(tmp_path / "kv"))
    engine.add_request("doc", DOC + [1, 2], ONE)  # 8 full blocks
    finish(engine)
    doc = hexes(engine.model_id, None, DOC + [1, 2])
    view = View(engine.drain_kv_events())
    engine.add_request("flush", [5] * 40, ONE)  # 10 blocks: the document's last 5 to disk
    finish(engine)
    engine.disk_cache.flush()
    view.apply(engine.drain_kv_events())
    assert set(doc) - view.held == set(doc[3:])
    assert all(engine.disk_cache.contains(bytes.fromhex(h)) for h in doc[3:])
    engine.add_request("again", DOC + [3], ONE)  # blocks 3-6 read back from disk: held again
    finish(engine)
    view.apply(engine.drain_kv_events())
    assert set(doc[:7]) <= view.held == cached_now(engine) and doc[7] not in view.held


def test_the_fake_engine_publishes_the_model_engines_hashes(make_tiny_engine, tiny_checkpoint):
    engine = make_tiny_engine()
    fake = FakeEngine(tiny_checkpoint.tokenizer, step_seconds=0, block_size=4,
                      model_id=engine.model_id)
    for e in (engine, fake):
        e.add_request("a", DOC, ONE, cache_salt="tenant")
        finish(e)
    real, simulated = engine.drain_kv_events(), fake.drain_kv_events()
    assert set(simulated.stored) == set(real.stored) == set(hexes(engine.model_id, "tenant", DOC))
    for e in (engine, fake):  # and both serve the same prefix from it
        e.add_request("b", DOC[:24] + [9, 9], ONE, cache_salt="tenant")
    assert fake.requests["b"].cached == 24
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()[0]
    assert outs[-1].usage.cached_tokens == 24


def test_the_fake_cache_evicts_least_recent_and_keeps_prefixes(tiny_checkpoint):
    fake = FakeEngine(tiny_checkpoint.tokenizer, step_seconds=0, block_size=4, num_blocks=10)
    fake.add_request("doc", DOC, FOUR)  # 7 prompt blocks
    finish(fake)  # and its output's: 30 + 3 computed tokens, 8 blocks
    doc = hexes(fake.model_id, None, DOC)
    fake.add_request("other", [5] * 13, ONE)  # 3 new blocks: 11 > 10, one eviction
    finish(fake)
    frame = fake.drain_kv_events()
    assert len(frame.removed) == 1 and len(fake.cache) == 10
    assert set(frame.removed).isdisjoint(set(frame.stored) | set(doc))  # the tail went
    fake.add_request("again", DOC + [1], ONE)
    assert fake.requests["again"].cached == 28  # the whole head stayed
    finish(fake)
    snap = fake.snapshot()
    assert snap["prefix_evictions"] == fake.cache.evictions == 1
    assert snap["prefix_hits"] == 28
    assert snap["prefix_queries"] == len(DOC) + 13 + len(DOC) + 1


def test_the_log_keeps_each_hash_once_with_its_latest_state():
    held: list[bytes] = []
    log = KvEventLog(lambda: held, limit=4)
    a, b = b"a" * 16, b"b" * 16
    log.stored(a)
    log.removed(a)  # gone again before any drain: reported removed (harmless for anyone)
    log.removed(b)
    log.stored(b)  # evicted then cached again: reported stored
    frame = log.drain()
    assert frame == KvEvents((b.hex(),), (a.hex(),), cleared=False)
    assert log.drain() is None


def test_the_log_collapses_into_a_snapshot_when_nobody_drains(tiny_checkpoint):
    fake = FakeEngine(tiny_checkpoint.tokenizer, step_seconds=0, block_size=4, num_blocks=16)
    limit = fake.cache.events.limit
    assert limit == event_limit(16)
    for i in range(limit):  # 2 new blocks each: far more hashes touched than the limit
        fake.add_request(f"r{i}", [i % 300, i // 300] * 4 + [1], ONE)
        assert fake.cache.events.num_pending <= limit
    finish(fake)
    frame = fake.drain_kv_events()
    assert frame.cleared and not frame.removed and len(frame.stored) == 16
    assert set(frame.stored) == set(fake.kv_snapshot().stored)
    assert fake.drain_kv_events() is None


def test_the_model_engines_log_is_bounded_by_its_pool(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=700)
    assert engine.kv.cached.events.limit == event_limit(700) == 1400
