"""Cache-aware routing: the prefix index folded from KV events, the gateway's hashes equal to the
worker's, dispatch to the longest cached prefix within the busy margin, the hash fallback, dead
and restarted workers, disaggregation's prefill stage, and a two-worker fleet of fake engines
where routing by cache beats the hash on the same multi-tenant shared-prefix workload."""
from __future__ import annotations

import asyncio

from contract.block_hashing import block_hashes, root_hash
from contract.frames import KvEvents, Ready
from contract.model_files import FAKE_MODEL_NAME
from contract.sampling_params import SamplingParams
from gateway.openai.requests import GenerationRequest
from gateway.serving.dispatch import Dispatcher, rendezvous_score
from gateway.serving.inflight import InFlightRequest, InFlightTable
from gateway.serving.queue import RequestQueue
from gateway.workers.handle import Placement, WorkerEvents, WorkerHandle
from gateway.workers.output_stream import OutputStream
from gateway.workers.prefix_index import PrefixHashes, PrefixIndex
from testkit.fleet_sim import Fleet, Workload, simulate

BS = 4
SALT = "tenant-a"


def chain(prompt, salt=SALT, model_id=FAKE_MODEL_NAME, block_size=BS) -> list[str]:
    """The worker's hashes of the prompt's full blocks (runtime/kv/prefix_cache.py)."""
    return [h.hex() for h in block_hashes(root_hash(model_id, salt), prompt, block_size)]


def events(stored=(), removed=(), cleared=False) -> KvEvents:
    return KvEvents(tuple(stored), tuple(removed), cleared)


# ---- the index ------------------------------------------------------------------------------
def test_the_gateway_hashes_a_prompt_as_the_worker_does():
    prompt = list(range(1, 23))  # 5 full blocks and 2 tokens over
    got = PrefixHashes(prompt, SALT).chain(FAKE_MODEL_NAME, BS)
    assert got.num_blocks == 5 and [got[i] for i in range(5)] == chain(prompt)
    exact = PrefixHashes(prompt[:20], SALT).chain(FAKE_MODEL_NAME, BS)
    assert exact.num_blocks == 4  # the last token is always computed: its block never counts
    other = PrefixHashes(prompt, "tenant-b").chain(FAKE_MODEL_NAME, BS)
    assert other[0] != got[0]


def test_the_index_folds_events_resets_on_cleared_and_on_a_new_incarnation():
    prompt = list(range(1, 30))
    h = chain(prompt)  # 7 blocks
    looked_up = PrefixHashes(prompt, SALT).chain(FAKE_MODEL_NAME, BS)
    index = PrefixIndex()
    index.apply(0, events(h[:5]), incarnation=11)
    assert index.cached_blocks(0, 11, looked_up) == 5
    index.apply(0, events(removed=[h[2]]), incarnation=11)
    assert index.cached_blocks(0, 11, looked_up) == 2  # a chain is useless past a hole
    assert index.num_held(0) == 4
    index.apply(0, events([h[2], h[5]], [h[4]]), incarnation=11)
    assert index.cached_blocks(0, 11, looked_up) == 4
    index.apply(0, events(h[:1], cleared=True), incarnation=11)  # a snapshot replaces the view
    assert index.num_held(0) == 1 and index.cached_blocks(0, 11, looked_up) == 1
    assert index.cached_blocks(0, 12, looked_up) == 0  # not for another process
    index.apply(0, events(h[3:5]), incarnation=12)  # a restarted worker starts empty
    assert index.num_held(0) == 2 and index.cached_blocks(0, 12, looked_up) == 0
    index.apply(1, events(h), incarnation=21)
    index.retain({1: 21})  # worker 0 died
    assert index.workers() == [1]
    index.retain({1: 22})  # worker 1 restarted
    assert index.workers() == []


# ---- dispatch -------------------------------------------------------------------------------
class _Pipe:
    def write(self, data: bytes) -> None:
        pass


class _Proc:
    returncode = None

    def __init__(self, pid: int):
        self.pid, self.stdin = pid, _Pipe()


class _ToDispatcher(WorkerEvents):
    def __init__(self):
        self.dispatcher: Dispatcher | None = None

    def on_kv_events(self, worker, frame) -> None:
        self.dispatcher.on_kv_events(worker, frame)


def _worker(index: int, listener: WorkerEvents, max_num_seqs: int = 8) -> WorkerHandle:
    w = WorkerHandle(index, [], events=listener)
    w.proc = _Proc(100 + index)
    w.info = Ready(pid=100 + index, model=FAKE_MODEL_NAME, max_model_len=4096, vocab_size=300,
                   num_blocks=1000, block_size=BS, max_num_seqs=max_num_seqs, device="fake",
                   eos_token_ids=[0], tokenizer="")
    w.ready.set()
    return w


def _busy(worker: WorkerHandle, n: int) -> None:
    for i in range(n):
        worker.inflight[f"busy-{worker.index}-{i}"] = Placement(OutputStream(), 0, 1)


def _job(prompt: list[int], salt: str | None = SALT) -> InFlightRequest:
    request = GenerationRequest("completion", None, None, tuple(prompt), 4, {})
    return InFlightRequest("job", request, prompt, "", SamplingParams(max_tokens=4), 0, salt)


def _fleet(n: int = 2, prefix_routing: bool = True, decode: int = 0):
    listener = _ToDispatcher()
    workers = [_worker(i, listener) for i in range(n + decode)]
    listener.dispatcher = Dispatcher(workers[:n], RequestQueue(16), InFlightTable(),
                                     affinity_margin=0.25, decode_workers=workers[n:] or None,
                                     prefix_routing=prefix_routing)
    return listener.dispatcher, workers


def _hashed_to(index: int, salt: str = SALT) -> list[int]:
    """A 70-token prompt (longer than the hash's key) whose rendezvous hash prefers worker
    `index` of two."""
    for start in range(1, 200):
        prompt = list(range(start, start + 70))
        key = _job(prompt, salt).affinity_key()
        if max((0, 1), key=lambda i: rendezvous_score(key, i)) == index:
            return prompt
    raise AssertionError("no such prompt")


def test_the_longest_cached_prefix_wins_over_the_hash():
    async def main():
        dispatcher, (w0, w1) = _fleet()
        prompt = _hashed_to(0)
        w0.events.on_kv_events(w0, events(chain(prompt)[:2]))
        w1._handle(events(chain(prompt)[:5]))  # through the handle's own frame handling
        assert dispatcher.choose(_job(prompt)) is w1
        w0._handle(events(chain(prompt)[2:7]))
        assert dispatcher.choose(_job(prompt)) is w0  # now the longer one
        assert dispatcher.choose(_job(prompt, "tenant-b")) is w0  # another salt: the hash
    asyncio.run(main())


def test_a_clearly_busier_holder_is_passed_over_at_the_margin():
    async def main():
        dispatcher, (w0, w1) = _fleet()
        prompt = _hashed_to(0)
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        dispatcher.on_kv_events(w0, events(chain(prompt)[:1]))
        _busy(w1, 2)  # 2 of 8 slots more than w0: exactly the margin (0.25), still eligible
        assert dispatcher.choose(_job(prompt)) is w1
        _busy(w1, 3)  # 3 more: clearly busier, so the shorter prefix on w0 wins
        assert dispatcher.choose(_job(prompt)) is w0
        _busy(w0, 3)  # equal load again: the longer prefix wins
        assert dispatcher.choose(_job(prompt)) is w1
    asyncio.run(main())


def test_a_busy_holder_and_no_other_holder_falls_back_to_the_least_loaded():
    async def main():
        dispatcher, (w0, w1) = _fleet()
        prompt = _hashed_to(1)
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        _busy(w1, 4)
        assert dispatcher.choose(_job(prompt)) is w0
    asyncio.run(main())


def test_with_no_block_held_identical_new_prefixes_meet_where_they_hash():
    async def main():
        for target in (0, 1):
            dispatcher, workers = _fleet()
            prompt = _hashed_to(target)
            dispatcher.on_kv_events(workers[1 - target], events(chain([299] * 70)))
            assert dispatcher.choose(_job(prompt)) is workers[target]
            assert dispatcher.choose(_job(prompt + [7, 8])) is workers[target]
    asyncio.run(main())


def test_hash_routing_alone_ignores_the_index():
    async def main():
        dispatcher, (w0, w1) = _fleet(prefix_routing=False)
        prompt = _hashed_to(0)
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        assert dispatcher.choose(_job(prompt)) is w0
    asyncio.run(main())


def test_a_dead_worker_leaves_the_index_and_a_restarted_one_starts_empty():
    async def main():
        dispatcher, (w0, w1) = _fleet()
        prompt = _hashed_to(0)
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        assert dispatcher.choose(_job(prompt)) is w1
        w1.proc.returncode = -9  # died; no frame says so
        assert dispatcher.choose(_job(prompt)) is w0
        assert dispatcher.prefix_index.workers() == []
        w1.proc = _Proc(999)  # restarted, before its first KV events
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        assert dispatcher.choose(_job(prompt)) is w1
        w1.proc = _Proc(1000)  # and again: the old process's blocks are not the new one's
        assert dispatcher.choose(_job(prompt)) is w0
    asyncio.run(main())


def test_a_lost_worker_reports_an_empty_cache():
    async def main():
        dispatcher, (w0, w1) = _fleet()
        prompt = _hashed_to(0)
        dispatcher.on_kv_events(w1, events(chain(prompt)))
        w1._lose("the connection dropped")  # the handle reports an empty cache
        assert dispatcher.prefix_index.num_held(1) == 0
    asyncio.run(main())


def test_disaggregation_routes_prefill_by_prefix_and_indexes_only_prefill_workers():
    async def main():
        dispatcher, (p0, p1, d0) = _fleet(2, decode=1)
        prompt = _hashed_to(0)
        dispatcher.on_kv_events(p1, events(chain(prompt)))
        dispatcher.on_kv_events(d0, events(chain(prompt)))  # decode workers place nothing
        assert dispatcher.prefix_index.workers() == [1]
        assert dispatcher.choose(_job(prompt)) is p1
        p1.inflight["long"] = Placement(OutputStream(), 0, 1200)  # prefill load: its tokens
        assert dispatcher.load_of(p1) > dispatcher.affinity_margin
        assert dispatcher.choose(_job(prompt)) is p0
    asyncio.run(main())


# ---- a fleet of fake engines ----------------------------------------------------------------
SMALL = Workload(tenants=3, prompts_per_tenant=2, system_tokens=240, preamble_tokens=80,
                 conversations=60, turns=(2, 4), user_tokens=(8, 24), max_tokens=8, rate=12.0,
                 think=0.5, skew=2.0)
ENGINE = {"block_size": BS, "num_blocks": 300, "max_num_seqs": 8,
          "prefill_seconds_per_token": 1e-4}


def test_the_index_mirrors_each_workers_cache_through_real_frames(tiny_checkpoint):
    async def main():
        fleet = Fleet(2, tiny_checkpoint.tokenizer, prefix_routing=True, engine_kwargs=ENGINE)
        turns = await fleet.run(SMALL)
        assert all(t.first_token is not None for t in turns)
        for w in fleet.workers:
            assert w.engine.cache.evictions > 0  # the caches were under pressure
            held = set(w.engine.kv_snapshot().stored)
            assert fleet.dispatcher.prefix_index._held[w.handle.index] == held
    asyncio.run(main())


def test_cache_aware_routing_hits_more_than_the_hash_on_shared_prefixes(tiny_checkpoint):
    runs = {mode: simulate(SMALL, tiny_checkpoint.tokenizer, prefix_routing=mode,
                           engine_kwargs=ENGINE) for mode in (False, True)}
    hashed, aware = runs[False], runs[True]
    assert hashed.requests == aware.requests == sum(
        len(c.turns) for c in SMALL.conversations_list())
    assert hashed.prompt_tokens == aware.prompt_tokens  # the fake's replies do not vary
    assert aware.hit_rate >= hashed.hit_rate > 0.3
    assert aware.cached_tokens > hashed.cached_tokens
