"""The console on live WebSockets: a scripted server (malformed frames, drops, bad key) and a
real gateway with the fake engine (load, spans, recording, a gateway restart)."""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from console.app import ConsoleApp
from console.feed import LiveFeed, Recorder, read_recording
from testkit import gateway_server
from testkit.gateway_server import GatewayProcess
from tests.console.conftest import fixed_clock, wait_until


def quick_feed(url: str, key: str | None = None, recorder: Recorder | None = None) -> LiveFeed:
    return LiveFeed(url, key, recorder=recorder, min_backoff=0.05, max_backoff=0.3)


async def scripted_server(script):
    """A loopback server whose /admin/telemetry runs script(ws, request, n) for connection n."""
    calls = []

    async def handler(request):
        calls.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer good":
            raise web.HTTPUnauthorized()
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await script(ws, len(calls))
        return ws

    app = web.Application()
    app.router.add_get("/admin/telemetry", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", calls


def test_reconnects_after_a_drop_and_survives_malformed_frames():
    snapshot = {"type": "snapshot", "uptime_s": 3.0, "workers": [{"index": 0, "device": "cpu"}]}

    async def script(ws, n):
        await ws.send_json({"type": "hello", "model": f"model-{n}", "workers": 1})
        if n == 1:
            for junk in ("not json", "[1, 2]", '{"type": "snapshot", "workers": [1, {"index":'):
                await ws.send_str(junk)
            await ws.send_bytes(b"\xff\xfe")
            await ws.send_json(snapshot)
            await ws.close()  # the gateway goes away
        else:
            await ws.send_json(snapshot)
            async for _ in ws:  # until the console goes
                pass

    async def main():
        runner, url, calls = await scripted_server(script)
        app = ConsoleApp(quick_feed(url, "good"), now=fixed_clock)
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                await wait_until(pilot, lambda: app.state.hello.get("model") == "model-2")
                await wait_until(pilot, lambda: app.state.connection.startswith("connected"))
                assert app.state.num_malformed == 4
                assert app.state.num_snapshots == 2 and app.state.worker_views()
                assert calls == ["Bearer good", "Bearer good"]
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_refused_key_is_shown_and_retried():
    async def main():
        runner, url, calls = await scripted_server(lambda ws, n: ws.close())
        app = ConsoleApp(quick_feed(url, "bad"), now=fixed_clock)
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                await wait_until(pilot, lambda: len(calls) >= 2)
                assert "HTTP 401" in app.state.connection
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def post_completions(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            body = {"prompt": "the same long prefix " * 6 + str(i % 2), "max_tokens": 20}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        await asyncio.gather(*(one(i) for i in range(n)))


def test_real_gateway_feed_recording_and_restart(tmp_path, monkeypatch):
    record = tmp_path / "live.jsonl"

    async def main():
        gw = await asyncio.to_thread(GatewayProcess, "--fake", "--fake-step-ms", "5")
        recorder = Recorder(record)
        app = ConsoleApp(quick_feed(gw.url, recorder=recorder), now=fixed_clock)
        try:
            async with app.run_test(size=(160, 45)) as pilot:
                await wait_until(pilot, lambda: app.state.connection.startswith("connected"))
                await post_completions(gw.url, 6)
                state = app.state
                await wait_until(pilot, lambda: len(state.traces) >= 6 and
                                 state.queue_view().finished >= 6)
                assert state.num_malformed == 0
                trace = next(iter(state.traces.traces.values()))
                assert {s.name for s in trace.spans.values()} == {
                    "llm.request", "queue", "prefill", "decode"}
                assert trace.attr("gen_ai.usage.output_tokens") == 20
                assert state.revenue_view().total > 0
                assert state.cache_view().hit_tokens > 0
                assert state.tenant_views()[0].requests >= 6
                assert state.worker_views()[0].kv_blocks_total > 0

                # the gateway restarts on the same port: the console follows it
                started = state.hello["started_at"]
                await asyncio.to_thread(gw.stop)
                await wait_until(pilot, lambda: state.connection.startswith(("disconnected",
                                                                             "connecting")))
                monkeypatch.setattr(gateway_server, "free_port", lambda: gw.port)
                gw2 = await asyncio.to_thread(GatewayProcess, "--fake", "--fake-step-ms", "5")
                try:
                    await wait_until(pilot, lambda: state.hello["started_at"] != started)
                    assert state.connection.startswith("connected")
                finally:
                    await asyncio.to_thread(gw2.stop)
        finally:
            await asyncio.to_thread(gw.stop)
            recorder.close()

    asyncio.run(main())
    frames = [f for _, f in read_recording(record)]
    assert all(f is not None for f in frames)
    assert [f["type"] for f in frames].count("hello") == 2
    assert "spans" in {f["type"] for f in frames}
