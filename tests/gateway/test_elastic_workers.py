"""Elastic capacity (gateway/serving/worker_pool.py, gateway/http/admin_workers.py).

A real fake-engine gateway and a real `python -m runtime serve --fake`: a remote worker added
while streams run takes requests; a worker drained with streams in flight lets them all
finish, leaves, and every request has its ledger row; the admin errors; the worker-seconds
counter grows with the pool's size. Then the autoscale decision over synthetic histories and
its loop over a pool without processes.
"""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import aiohttp
import pytest

from gateway.serving.autoscale import Policy, Sample, autoscale_loop, decide, policy_from_config
from gateway.serving.worker_pool import WorkerPool
from gateway.telemetry.metrics import WorkerSeconds
from testkit.gateway_server import GatewayProcess
from tests.runtime.test_serve import FAKE, ServeProcess

TOKENS = 150  # 10 ms a step: streams that last well past the pool change


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    ledger = tmp_path_factory.mktemp("elastic") / "ledger.sqlite3"
    gateway = GatewayProcess("--fake", "--fake-step-ms", "10", "--ledger-path", str(ledger))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def serve():
    server = ServeProcess(*FAKE)
    yield server
    server.stop()


async def call(session, method: str, url: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with session.request(method, url, data=data,
                               headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def stream(session, base: str, i: int, max_tokens: int = TOKENS) -> tuple[int, str]:
    """One streamed completion with a prompt of its own: (tokens, finish reason)."""
    body = {"model": "fake-smollm2", "prompt": f"request {i} " * 4, "max_tokens": max_tokens,
            "stream": True}
    tokens, reason = 0, ""
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += bool(choice["text"])
                reason = choice["finish_reason"] or reason
    return tokens, reason


async def workers(session, base: str) -> list[dict]:
    status, body = await call(session, "GET", base + "/admin/workers")
    assert status == 200
    return body["data"]


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def ledger_requests(session, base: str) -> int:
    _, body = await call(session, "GET", base + "/admin/usage?period=all")
    return sum(row["requests"] for row in body["data"])


async def trim_to_one(session, base: str) -> None:
    for w in (await workers(session, base))[1:]:
        status, _ = await call(session, "DELETE", f"{base}/admin/workers/{w['index']}?wait=1")
        assert status == 200


def test_a_remote_worker_added_while_streams_run_takes_requests(gw, serve):
    async def main():
        async with aiohttp.ClientSession() as s:
            running = [asyncio.create_task(stream(s, gw.url, i)) for i in range(4)]
            status, added = await call(s, "POST", gw.url + "/admin/workers", {"url": serve.url})
            assert status == 201, added
            assert added["kind"] == "remote" and added["url"] == serve.url and added["alive"]
            later = [asyncio.create_task(stream(s, gw.url, 100 + i)) for i in range(16)]

            async def remote_busy():
                ws = {w["index"]: w for w in await workers(s, gw.url)}
                return ws[added["index"]]["running"] > 0
            await until(remote_busy)
            results = await asyncio.gather(*running, *later)
            assert results == [(TOKENS, "length")] * 20
            await trim_to_one(s, gw.url)
    asyncio.run(main())


def test_a_drained_worker_finishes_its_streams_and_leaves(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            before = await ledger_requests(s, gw.url)
            status, spawned = await call(s, "POST", gw.url + "/admin/workers", {"spawn": True})
            assert status == 201 and spawned["kind"] == "local" and spawned["pid"]
            index = spawned["index"]
            streams = [asyncio.create_task(stream(s, gw.url, 200 + i)) for i in range(16)]

            async def busy():
                ws = {w["index"]: w for w in await workers(s, gw.url)}
                return ws[index]["running"] > 0
            await until(busy)
            status, body = await call(s, "DELETE", f"{gw.url}/admin/workers/{index}")
            assert status == 202 and body["draining"] and body["running"] > 0
            # new work while it drains goes to the other worker only: its count only falls
            at_delete, seen = body["running"], []
            after = [asyncio.create_task(stream(s, gw.url, 300 + i, 20)) for i in range(8)]
            while not all(t.done() for t in after):
                seen += [w["running"] for w in await workers(s, gw.url) if w["index"] == index]
                await asyncio.sleep(0.02)
            assert [t.result() for t in after] == [(20, "length")] * 8
            assert seen and max(seen) <= at_delete
            assert await asyncio.gather(*streams) == [(TOKENS, "length")] * 16

            async def gone():
                return all(w["index"] != index for w in await workers(s, gw.url))
            await until(gone)
            assert await ledger_requests(s, gw.url) == before + 24
        assert gw.metric("vllm:request_success_total") >= 20
        assert f'worker="{index}"' not in gw.get("/metrics")[1].decode()
    asyncio.run(main())


def test_admin_worker_errors_have_openai_bodies(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            base = gw.url + "/admin/workers"
            cases = [(None, b"not json"), ({}, None), ({"url": 5}, None),
                     ({"url": "http://127.0.0.1:1"}, None), ({"spawn": False}, None),
                     ({"url": "tcp://127.0.0.1:1", "spawn": True}, None), ([1], None)]
            for body, raw in cases:
                status, err = await call(s, "POST", base, body, raw)
                assert status == 400, (body, err)
                assert set(err["error"]) == {"message", "type", "param", "code"}
            status, err = await call(s, "DELETE", base + "/9999")
            assert status == 404 and err["error"]["type"] == "not_found_error"
            status, err = await call(s, "DELETE", base + "/x")
            assert status == 400
            await trim_to_one(s, gw.url)
            (only,) = await workers(s, gw.url)
            status, err = await call(s, "DELETE", f"{base}/{only['index']}")
            assert status == 409 and err["error"]["code"] == "conflict"
            assert len(await workers(s, gw.url)) == 1
    asyncio.run(main())


def test_worker_seconds_grow_with_the_pool_size(gw):
    """Between two scrapes the counter grows by the pool's size times the time between
    them: bounded by the times just outside and just inside the two scrapes."""
    name = "inferstack:worker_seconds_total"

    def grown() -> tuple[float, float, float]:
        t0 = time.time()
        first = gw.metric(name)
        t1 = time.time()
        time.sleep(1.0)
        t2 = time.time()
        second = gw.metric(name)
        t3 = time.time()
        return second - first, t2 - t1, t3 - t0

    async def spawn():
        async with aiohttp.ClientSession() as s:
            await trim_to_one(s, gw.url)
            status, _ = await call(s, "POST", gw.url + "/admin/workers", {"spawn": True})
            assert status == 201

    async def trim():
        async with aiohttp.ClientSession() as s:
            await trim_to_one(s, gw.url)

    asyncio.run(trim())
    delta, shortest, longest = grown()
    assert shortest <= delta <= longest
    asyncio.run(spawn())
    delta, shortest, longest = grown()
    assert 2 * shortest <= delta <= 2 * longest
    asyncio.run(trim())


def test_the_worker_clock_integrates_size_over_time():
    clock = WorkerSeconds(1, now=100.0)
    clock.resize(3, now=110.0)  # 10 s at 1
    clock.resize(2, now=120.0)  # 10 s at 3
    assert clock.total(now=130.0) == pytest.approx(10 + 30 + 20)
    assert clock.between(105.0, 125.0) == pytest.approx(5 + 30 + 10)
    assert clock.between(50.0, 100.0) == pytest.approx(50.0)  # before: the first size


class FakeWorker:
    """A handle without a process: its requests end when aborted (their final, billed
    outputs) or when `finish` is called."""
    supervised = True

    def __init__(self, index: int, running: tuple[str, ...] = ()):
        self.index, self.inflight = index, dict.fromkeys(running)
        self.aborted: list[str] = []
        self.closed = False
        self.alive, self.pid = True, 100 + index

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.inflight.pop(request_id)

    async def close(self) -> None:
        self.closed, self.alive = True, False


def fake_pool(workers, drain_timeout: float) -> WorkerPool:
    dispatcher = SimpleNamespace(draining=set(), disaggregated=False, notify=lambda: None,
                                 prefix_index=SimpleNamespace(retain=lambda alive: None),
                                 worker_time=WorkerSeconds(len(workers)))
    state = SimpleNamespace(workers=list(workers), dispatcher=dispatcher, metrics=None,
                            stop=asyncio.Event())
    return WorkerPool(state, drain_timeout)


def test_a_drain_past_its_timeout_aborts_what_still_runs():
    async def main():
        stuck, other = FakeWorker(1, ("a", "b")), FakeWorker(0, ("c",))
        pool = fake_pool([other, stuck], drain_timeout=0.1)
        await pool.drain(1)
        assert stuck.aborted == ["a", "b"] and stuck.closed
        assert pool.workers == [other] and other.aborted == [] and not other.closed
        assert pool.state.dispatcher.draining == set() and pool.removed == 1
        assert pool.state.dispatcher.worker_time.count == 1
    asyncio.run(main())


def test_a_drain_within_its_timeout_aborts_nothing():
    async def main():
        busy = FakeWorker(1, ("a",))
        pool = fake_pool([FakeWorker(0), busy], drain_timeout=30.0)
        task = pool.drain(1)
        assert pool.drain(1) is task  # asking twice is one drain
        await asyncio.sleep(0.2)
        assert not task.done() and 1 in pool.state.dispatcher.draining
        busy.inflight.clear()  # its last request finished
        await task
        assert busy.aborted == [] and busy.closed and len(pool.workers) == 1
    asyncio.run(main())


# ---- the autoscale decision -------------------------------------------------------------
POLICY = Policy(min_workers=1, max_workers=3, queue_depth=2, grow_seconds=5,
                idle_seconds=10, cooldown_seconds=3)


def history(seconds: int, queue, running) -> list[Sample]:
    """A sample a second; `queue` and `running` are functions of the second."""
    return [Sample(float(t), queue(t), running(t)) for t in range(seconds + 1)]


def test_growth_needs_a_queue_held_for_the_whole_window():
    busy = lambda t: ((0, 8), (1, 8))  # noqa: E731
    assert decide(history(6, lambda t: 5, busy), POLICY).action == "grow"
    blip = history(6, lambda t: 5 if t != 3 else 0, busy)
    assert decide(blip, POLICY).action == "hold"
    assert decide(history(3, lambda t: 5, busy), POLICY).action == "hold"  # too short
    assert decide(history(6, lambda t: 2, busy), POLICY).action == "hold"  # at threshold


def test_shrinking_drains_an_idle_worker_never_below_min():
    idle_one = lambda t: ((0, 3), (1, 0), (2, 0))  # noqa: E731
    d = decide(history(12, lambda t: 0, idle_one), POLICY)
    assert d.action == "shrink" and d.worker == 2
    was_busy = lambda t: ((0, 3), (1, 0), (2, 1 if t == 5 else 0))  # noqa: E731
    d = decide(history(12, lambda t: 0, was_busy), POLICY)
    assert d.action == "shrink" and d.worker == 1
    assert decide(history(12, lambda t: 1, idle_one), POLICY).action == "hold"  # a queue
    assert decide(history(6, lambda t: 0, idle_one), POLICY).action == "hold"  # too short
    single = lambda t: ((0, 0),)  # noqa: E731
    assert decide(history(30, lambda t: 0, single), POLICY).action == "hold"  # the min


def test_bounds_and_cooldown():
    full = lambda t: ((0, 8), (1, 8), (2, 8))  # noqa: E731
    assert decide(history(10, lambda t: 9, full), POLICY).action == "hold"  # at the max
    over = lambda t: ((0, 1), (1, 0), (2, 4), (3, 2))  # noqa: E731
    d = decide(history(1, lambda t: 9, over), POLICY)
    assert d.action == "shrink" and d.worker == 1
    assert decide([Sample(0.0, 0, ())], POLICY).action == "grow"  # below the min
    busy = lambda t: ((0, 8),)  # noqa: E731
    assert decide(history(6, lambda t: 5, busy), POLICY, last_change=5.0).action == "hold"
    assert decide(history(9, lambda t: 5, busy), POLICY, last_change=5.0).action == "grow"
    assert decide([], POLICY).action == "hold"


def test_the_policy_is_off_without_a_maximum():
    assert policy_from_config(SimpleNamespace()) is None
    p = policy_from_config(SimpleNamespace(autoscale_min=2, autoscale_max=4))
    assert (p.min_workers, p.max_workers) == (2, 4)


def test_the_loop_grows_under_a_queue_and_shrinks_when_idle():
    """The loop over a pool without processes: a held queue spawns, idleness drains."""
    class Pool:
        def __init__(self):
            self.workers = [SimpleNamespace(index=0, num_inflight=1)]
            self.queue: list = [1, 2, 3]
            self.state = SimpleNamespace(queue=self.queue,
                                         dispatcher=SimpleNamespace(draining=set()))
            self.drains: dict = {}
            self.spawned = self.drained = 0

        async def spawn(self):
            self.spawned += 1
            self.workers.append(SimpleNamespace(index=len(self.workers), num_inflight=0))
            self.queue.clear()  # the new capacity takes the queue

        def drain(self, index):
            self.drained += 1
            self.workers = [w for w in self.workers if w.index != index]

    async def main():
        pool, stop = Pool(), asyncio.Event()
        policy = Policy(1, 2, 0, grow_seconds=0.1, idle_seconds=0.2, cooldown_seconds=0.05)
        task = asyncio.create_task(autoscale_loop(pool, policy, stop, interval=0.02))
        await until_sync(lambda: pool.spawned == 1 and pool.drained == 1)
        stop.set()
        await task
        assert [w.index for w in pool.workers] == [0] and pool.spawned == 1

    async def until_sync(predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)
    asyncio.run(main())
