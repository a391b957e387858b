"""Gateways sharing workers over the network (runtime/transport/serve.py,
gateway/workers/remote_handle.py).

The gateway's RemoteWorkerHandle against a real `python -m runtime serve`: the engine contract
over TCP, the secret both ways, load that counts other gateways, a worker killed mid-stream
failing its requests and then reconnected to, and KV events reaching the listener from pipe
and network workers alike. Then real `python -m gateway` processes with `--worker-url`: two at
once on one worker with their outputs apart, one SIGKILLed mid-stream with its requests
aborted on the worker while the other streams on, and a restarted worker served again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time

import aiohttp
import pytest

from contract.frames import TOKEN_ENV, AddRequest, KvEvents
from contract.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.workers.events import WorkerDied, WorkerEvents
from gateway.workers.handle import WorkerHandle
from gateway.workers.output_stream import OutputStream
from gateway.workers.remote_handle import (
    RemoteWorkerHandle,
    parse_worker_url,
    remote_worker_handles,
)
from testkit.gateway_server import GatewayProcess
from tests.runtime import test_engine_contract as contract
from tests.runtime.test_serve import FAKE, LONG, SECRET, FrameClient, ServeProcess

WIRED = "worker_urls" in {f.name for f in dataclasses.fields(GatewayConfig)}
needs_wiring = pytest.mark.skipif(not WIRED, reason="the gateway has no --worker-url yet "
                                  "(gateway/config.py and gateway/app.py wiring)")


class Recorder(WorkerEvents):
    """What a handle reports to the gateway, in order."""

    def __init__(self):
        self.outputs: list[dict] = []
        self.kv: list[KvEvents] = []
        self.readies = 0

    def ready(self, worker) -> None:
        self.readies += 1

    def output(self, worker, out) -> None:
        self.outputs.append(out)

    def on_kv_events(self, worker, frame) -> None:
        self.kv.append(frame)


def add(rid: str, prompt: list[int], max_tokens: int) -> AddRequest:
    return AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def serve():
    server = ServeProcess(*FAKE)
    yield server
    server.stop()


# ---- the handle ------------------------------------------------------------------------
@pytest.mark.parametrize("url,address", [
    ("tcp://127.0.0.1:9000", ("127.0.0.1", 9000)), ("tcp://[::1]:9", ("::1", 9)),
    ("tcp://worker-3.internal:7000/", ("worker-3.internal", 7000))])
def test_worker_urls(url, address):
    assert parse_worker_url(url) == address


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "tcp://127.0.0.1", "127.0.0.1:9000",
                                 "tcp://:9000", "tcp://h:99999", "tcp://h:1/x", "tcp://h:1?a"])
def test_bad_worker_urls_are_refused(url):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_worker_url(url)


def test_handles_are_numbered_after_the_local_workers_and_take_the_secret(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    events = Recorder()
    handles = remote_worker_handles(["tcp://a:1", "tcp://b:2"], events, first_index=3)
    assert [(h.index, h.host, h.port, h.token) for h in handles] == [
        (3, "a", 1, SECRET), (4, "b", 2, SECRET)]
    assert all(h.events is events and not h.supervised for h in handles)


def test_the_engine_contract_holds_over_the_network(serve):
    class OverNetwork(contract.OverFrames):
        def __init__(self):
            self.handle = RemoteWorkerHandle(0, serve.url, ready_timeout=120)
            self.stream = OutputStream()

    async def main():
        for scenario in contract.SCENARIOS:  # each on a fresh connection: ids start over
            driver = await OverNetwork().start()
            try:
                await scenario(driver)
            finally:
                await driver.close()
    asyncio.run(main())


def test_the_secret_is_proved_both_ways(serve):
    secret = ServeProcess(*FAKE, token=SECRET)

    async def refused(url, token, match):
        handle = RemoteWorkerHandle(0, url, token)
        try:
            with pytest.raises(ConnectionError, match=match):
                await handle.start()
            assert not handle.alive
        finally:
            await handle.close()

    async def main():
        await refused(secret.url, None, TOKEN_ENV)
        await refused(secret.url, "a-wrong-secret-of-some-length", "refused")
        await refused(serve.url, SECRET, "asks for no secret")
        handle = RemoteWorkerHandle(0, secret.url, SECRET)
        try:
            await handle.start()
            assert handle.alive and handle.info.pid == secret.proc.pid
        finally:
            await handle.close()
    try:
        asyncio.run(main())
    finally:
        secret.stop()


def test_load_counts_the_other_gateways_requests(serve):
    async def main():
        mine, theirs = RemoteWorkerHandle(0, serve.url), RemoteWorkerHandle(1, serve.url)
        await mine.start()
        await theirs.start()
        try:
            stream = OutputStream()
            theirs.submit([add(f"t{i}", [1, 2, 3], LONG) for i in range(3)], stream, 0, 3)
            await until(lambda: mine.stats.get("running") == 3)
            assert mine.num_inflight == 0 and mine.others_requests == 3
            assert mine.free_slots == mine.max_num_seqs - 3
            assert mine.load == 3 / mine.max_num_seqs
            assert theirs.others_requests == 0  # its own requests are not others'
        finally:
            await mine.close()
            await theirs.close()
    asyncio.run(main())


def test_a_killed_worker_fails_its_requests_then_the_handle_reconnects():
    server = ServeProcess(*FAKE)
    restarted = None

    async def main():
        nonlocal restarted
        events = Recorder()
        handle = RemoteWorkerHandle(0, server.url, events=events, max_backoff=0.5)
        await handle.start()
        try:
            stream = OutputStream()
            handle.submit([add("lost", [1, 2, 3], LONG)], stream, 0, 3)
            assert not (await asyncio.wait_for(stream.get(), 30))["finished"]
            server.kill()
            while not isinstance(item := await asyncio.wait_for(stream.get(), 30), WorkerDied):
                assert not item["finished"]
            assert not handle.alive and handle.num_inflight == 0
            final = events.outputs[-1]
            assert final["id"] == "lost" and final["reason"] == "error" and final["usage"] is None
            assert events.kv[-1] == KvEvents((), (), cleared=True)  # it holds nothing now
            restarted = ServeProcess(*FAKE, port=server.port)
            await until(lambda: handle.alive)
            assert handle.restarts == 1 and events.readies == 2
            assert handle.pid == restarted.proc.pid
            again = OutputStream()
            handle.submit([add("again", [1, 2, 3], 4)], again, 0, 3)
            outs = [await asyncio.wait_for(again.get(), 30) for _ in range(4)]
            assert outs[-1]["finished"] and outs[-1]["usage"][2] == 4
        finally:
            await handle.close()
    try:
        asyncio.run(main())
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


def test_kv_events_reach_the_listener_from_pipe_and_network_workers(serve):
    async def through(handle: WorkerHandle, events: Recorder) -> None:
        await handle.start()
        try:
            await until(lambda: events.kv)
            assert events.kv[0].cleared  # the state, right after Ready
            stream = OutputStream()
            prompt = [300 + x for x in os.urandom(40)]  # never seen: 2 full blocks of 16
            handle.submit([add("kv", prompt, 2)], stream, 0, len(prompt))
            while not (await asyncio.wait_for(stream.get(), 30))["finished"]:
                pass
            await until(lambda: any(f.stored for f in events.kv[1:]))
        finally:
            await handle.close()

    async def main():
        for make in (lambda e: WorkerHandle(0, list(FAKE), events=e),
                     lambda e: RemoteWorkerHandle(0, serve.url, events=e)):
            events = Recorder()
            await through(make(events), events)
            assert events.kv[-1] == KvEvents((), (), cleared=True)  # closed: nothing held
    asyncio.run(main())


# ---- gateways ----------------------------------------------------------------------------
def gateway(serve: ServeProcess) -> GatewayProcess:
    return GatewayProcess("--fake", "--workers", "0", "--worker-url", serve.url)


async def complete(session, gw: GatewayProcess, max_tokens: int, prompt: str) -> dict:
    async with session.post(gw.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def open_stream(session, gw: GatewayProcess, max_tokens: int = LONG):
    resp = await session.post(gw.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": max_tokens, "stream": True})
    assert resp.status == 200
    await resp.content.readline()  # the first chunk: running on the worker
    return resp


@needs_wiring
def test_two_gateways_share_one_worker_and_their_outputs_never_cross(serve):
    first, second = gateway(serve), gateway(serve)
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                jobs = [complete(s, gw, n, f"prompt {i}") for i in range(4)
                        for gw, n in ((first, 7), (second, 13))]
                return await asyncio.gather(*jobs)
        results = asyncio.run(main())
        for i, body in enumerate(results):
            n = 7 if i % 2 == 0 else 13
            assert body["usage"]["completion_tokens"] == n
            assert body["choices"][0]["finish_reason"] == "length"
        texts = {r["choices"][0]["text"] for r in results}
        assert len(texts) == 2  # the fake's words, cut at 7 or at 13 tokens: nothing mixed in
        for gw in (first, second):
            assert json.loads(gw.get("/ready")[1])["worker_pids"] == [serve.proc.pid]
    finally:
        first.stop()
        second.stop()


@needs_wiring
def test_a_killed_gateways_requests_are_aborted_while_the_other_streams_on(serve):
    doomed, survivor = gateway(serve), gateway(serve)
    observer = FrameClient(serve.port)
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                streams = [await open_stream(s, doomed) for _ in range(3)]
                kept = await open_stream(s, survivor)
                await asyncio.to_thread(observer.stats_where, lambda st: st["running"] == 4)
                os.killpg(doomed.proc.pid, signal.SIGKILL)
                doomed.proc.wait()
                after = await asyncio.to_thread(observer.stats_where,
                                                lambda st: st["running"] == 1)
                assert after["waiting"] == 0
                for _ in range(5):  # the survivor's stream goes on
                    line = await asyncio.wait_for(kept.content.readline(), 30)
                    assert line.startswith((b"data: {", b"\n", b":"))
                kept.close()  # its client leaves: the survivor aborts it
                for resp in streams:
                    resp.close()
        asyncio.run(main())
        idle = observer.stats_where(lambda st: True, idle=True)
        assert (idle["running"], idle["waiting"], idle["kv_blocks_used"]) == (0, 0, 0)
    finally:
        observer.close()
        doomed.stop()
        survivor.stop()


@needs_wiring
def test_a_restarted_worker_is_reconnected_to_and_serves_again():
    server = ServeProcess(*FAKE)
    gw = gateway(server)
    restarted = None
    try:
        async def cut() -> bytes:
            async with aiohttp.ClientSession() as s:
                resp = await open_stream(s, gw)
                server.kill()
                return await resp.read()
        rest = asyncio.run(cut())
        assert b'"error"' in rest and rest.endswith(b"data: [DONE]\n\n")
        restarted = ServeProcess(*FAKE, port=server.port)
        deadline = time.monotonic() + 60
        while json.loads(gw.get("/ready")[1]).get("worker_pids") != [restarted.proc.pid]:
            assert time.monotonic() < deadline, "the gateway did not reconnect"
            time.sleep(0.2)

        async def again():
            async with aiohttp.ClientSession() as s:
                return await complete(s, gw, 3, "again")
        assert asyncio.run(again())["usage"]["completion_tokens"] == 3
        assert gw.metric("inferstack:worker_restarts") == 1
    finally:
        gw.stop()
        server.stop()
        if restarted is not None:
            restarted.stop()


def test_a_gateway_leaving_cleanly_aborts_what_it_had_on_the_worker(serve):
    """close() sends Shutdown: the worker drops this gateway's requests and serves on."""
    observer = FrameClient(serve.port)

    async def main():
        handle = RemoteWorkerHandle(0, serve.url)
        await handle.start()
        handle.submit([add("leaving", [1, 2, 3], LONG)], OutputStream(), 0, 3)
        await asyncio.to_thread(observer.stats_where, lambda st: st["running"] == 1)
        await handle.close()
    try:
        asyncio.run(main())
        idle = observer.stats_where(lambda st: True, idle=True)
        assert (idle["running"], idle["kv_blocks_used"]) == (0, 0)
    finally:
        observer.close()
