"""Queued requests whose clients leave are removed from the queue at once: their memory is
freed while the line is still blocked, and `max_queue` bounds what the queue holds.

Before: removal only flagged the entry; the heap (and the request it holds, prompt and all)
kept it until it reached the front, so under a blocked line the gateway grew by every
cancelled request (issue: +111 MiB for 1,040 of them; here +93 MiB for 282 requests of 6,000
token ids). The memory is checked below HTTP, with the cyclic GC off (freed at once means
freed by reference counting): the HTTP layer's own objects of a cancelled stream are left to
the GC, which a gateway-level RSS reading would measure instead.
"""
from __future__ import annotations

import asyncio
import gc
import random
import time
import weakref

import aiohttp
import pytest

from gateway.openai.requests import GenerationRequest
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase
from gateway.serving.queue import QueueEntry, RequestQueue
from tests.reliability.conftest import Gateway, auth

SLOTS = 2
MAX_QUEUE = 48
ROUNDS = 6
PROMPT_TOKENS = 500  # token ids; kept small: conftest allows a case 20 MiB of growth


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """Named `gw` so that conftest's after-every-case check (nothing leaked) runs here."""
    server = Gateway(tmp_path_factory.mktemp("qc"), "--fake-step-ms", "5", "--max-num-seqs",
                     str(SLOTS), "--max-queue", str(MAX_QUEUE))
    yield server
    server.stop()


async def post(session, url: str, body: dict) -> int:
    async with session.post(url + "/v1/completions", json=body, headers=auth("sk-alpha")) as r:
        await r.read()
        return r.status


async def wait_queue(gw: Gateway, n: int, timeout: float = 20.0) -> float:
    """Seconds until the gateway's queue length is `n` (as /metrics reports it)."""
    start = time.monotonic()
    while gw.metric("inferstack:gateway_queue_length") != n:
        assert time.monotonic() - start < timeout, \
            f"queue length {gw.metric('inferstack:gateway_queue_length')}, expected {n}"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def big_body(rng: random.Random) -> dict:
    return {"prompt": [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
            "max_tokens": 1, "stream": True}


def test_cancelled_queue_entries_are_freed_at_once(gw):
    rng = random.Random(7)
    bodies = [big_body(rng) for _ in range(MAX_QUEUE - 1)]

    async def main():
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            url = gw.url
            long = {"prompt": "hold", "max_tokens": 4000, "stream": True}
            blockers = [asyncio.create_task(post(s, url, long)) for _ in range(SLOTS)]
            while gw.metric("inferstack:worker_slots_in_use") < SLOTS:
                await asyncio.sleep(0.01)
            head = asyncio.create_task(post(s, url, {"prompt": "head", "max_tokens": 2}))
            await wait_queue(gw, 1)  # a live request heads the blocked line
            drops, outcomes = [], []
            for _ in range(ROUNDS):  # each round fills the queue, then every client leaves
                waiting = [asyncio.create_task(post(s, url, b)) for b in bodies]
                await wait_queue(gw, MAX_QUEUE)  # max_queue admitted a full queue again
                for t in waiting:
                    t.cancel()
                outcomes += await asyncio.gather(*waiting, return_exceptions=True)
                drops.append(await wait_queue(gw, 1))
            for t in [*blockers, head]:
                t.cancel()
            await asyncio.gather(*blockers, head, return_exceptions=True)
            return drops, outcomes
    drops, outcomes = asyncio.run(main())
    assert max(drops) < 1.0, drops  # left the queue as their clients left
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)  # never a 429
    deadline = time.monotonic() + 10  # rows are committed by the ledger's writer, in batches
    while len(gw.ledger_rows("status = 'cancelled'")) < ROUNDS * (MAX_QUEUE - 1):
        assert time.monotonic() < deadline, "a cancelled request has no ledger row"
        time.sleep(0.1)


def test_removed_entries_leave_the_queue_and_free_their_request():
    """The queue holds exactly its live entries: a removed one is released at once."""
    class Job:  # a stand-in for the in-flight record the entry carries
        pass

    queue = RequestQueue(8)
    jobs = [Job() for _ in range(8)]
    entries = [QueueEntry(f"r{i}", 0, jobs[i], arrival=float(i)) for i in range(8)]
    assert [queue.push(e) for e in entries] == [None] * 8
    alive = [weakref.ref(j) for j in jobs[1:]]
    assert all([queue.remove(e) for e in entries[1:]])
    del jobs, entries[1:]
    gc.collect()
    assert [r() for r in alive] == [None] * 7  # before: every one held by the heap
    assert len(queue) == 1 and len(queue.waiting()) == 1
    assert queue.pop() is entries[0] and queue.peek() is None


def test_a_cancelled_queued_job_is_freed_at_once():
    """What the service does when a queued request's client leaves (`Dispatcher.cancel`):
    the record, its prompt and its entry are freed by reference counting alone, while a live
    job still heads the blocked line."""
    def job(i: int) -> InFlightRequest:
        prompt = list(range(1000, 1000 + PROMPT_TOKENS))
        request = GenerationRequest("completion", None, None, tuple(prompt), 4, {})
        return InFlightRequest(f"r{i}", request, prompt, "", request.sampling_params(4), 0,
                               None)

    async def main():
        dispatcher = Dispatcher([], RequestQueue(MAX_QUEUE), InFlightTable())  # no room
        jobs = [job(i) for i in range(MAX_QUEUE)]
        for rec in jobs:
            dispatcher.table.move(rec, Phase.QUEUED)
            dispatcher.enqueue(rec)
        for rec in jobs[1:]:
            assert dispatcher.cancel(rec)
            dispatcher.table.move(rec, Phase.SETTLING)  # the accounting's drop: not billed
            dispatcher.table.move(rec, Phase.DONE)
        refs = [weakref.ref(rec) for rec in jobs[1:]]
        del jobs[1:], rec
        return dispatcher, jobs[0], refs

    gc.disable()
    try:
        dispatcher, head, refs = asyncio.run(main())
        assert sum(r() is not None for r in refs) == 0  # before: all held by the heap
    finally:
        gc.enable()
    assert len(dispatcher.queue) == 1 and dispatcher.queue.peek() is head.entry


def test_queue_order_matches_a_sorted_reference_under_removal():
    """The queue (per-tenant lines merged by their heads) pops in exactly the aged
    fair-share order a single sorted list gives, whatever is removed meanwhile."""
    rng = random.Random(3)
    queue = RequestQueue(10_000)
    ref: list[QueueEntry] = []
    for i in range(3000):
        op = rng.random()
        if op < 0.55 or not ref:
            e = QueueEntry(f"r{i}", rng.randrange(3), None, arrival=rng.random() * 100,
                           tenant=rng.choice("abcde"))
            queue.push(e)
            ref.append(e)
        elif op < 0.8:
            e = ref.pop(rng.randrange(len(ref)))
            assert queue.remove(e) and not queue.remove(e)
        else:
            ref.sort(key=lambda e: (e.key, e.seq))
            assert queue.pop() is ref.pop(0)
        assert len(queue) == len(ref)
    ref.sort(key=lambda e: (e.key, e.seq))
    assert [queue.pop() for _ in range(len(ref))] == ref and queue.peek() is None
