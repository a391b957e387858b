"""Spans, /metrics, the live feed and OTLP export on an in-process gateway (fake engine)."""
import asyncio
import time

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import STATE
from gateway.telemetry.feed import FeedHub

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def gateway_config(tmp_path, **overrides):
    return GatewayConfig(fake=True, fake_step_ms=3, ledger_path=str(tmp_path / "l.sqlite3"),
                         **overrides)


async def ready(client: TestClient) -> None:
    for _ in range(600):
        if (await client.get("/ready")).status == 200:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("gateway not ready")


def run_app(config, scenario, in_memory=True):
    async def main():
        app = create_app(config, in_memory_spans=in_memory)
        async with TestClient(TestServer(app)) as client:
            await ready(client)
            return await scenario(client, app[STATE])
    return asyncio.run(main())


def attrs(span):
    return dict(span.attributes)


def test_request_span_tree_and_attributes(tmp_path):
    async def scenario(client, state):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                              headers={"traceparent": TRACEPARENT})
        body = await r.json()
        for _ in range(100):
            if any(s.name == "llm.request" for s in state.telemetry.memory.get_finished_spans()):
                break
            await asyncio.sleep(0.02)
        return body, state.telemetry.memory.get_finished_spans()
    body, spans = run_app(gateway_config(tmp_path), scenario)
    by_name = {s.name: s for s in spans}
    root = by_name["llm.request"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID  # the client's trace continues
    for child in ("queue", "prefill", "decode"):
        assert by_name[child].parent.span_id == root.context.span_id
        assert by_name[child].start_time <= by_name[child].end_time
    a = attrs(root)
    assert a["tenant"] == "default" and a["finish_reason"] == "length"
    assert a["gen_ai.usage.output_tokens"] == 4 and a["worker"] == 0 and a["device"] == "fake"
    assert a["cost.total"] == body["usage"]["cost"]["total"]
    assert 0 < a["ttft_s"] < 5 and a["request.id"] == body["id"]


def test_metrics_parse_as_prometheus_text(tmp_path):
    async def scenario(client, state):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        return await (await client.get("/metrics")).text()
    text = run_app(gateway_config(tmp_path), scenario, in_memory=False)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits",  # a counter: _total
                 "inferstack:revenue_usd", "vllm:generation_tokens"):
        assert name in families, name
    revenue = {s.labels["kind"]: s.value for s in families["inferstack:revenue_usd"].samples
               if s.name.endswith("_total")}
    assert revenue["output"] > 0
    tokens = [s.value for s in families["vllm:generation_tokens"].samples
              if s.name.endswith("_total")]
    assert tokens == [3.0]


def test_live_feed_sends_hello_snapshots_and_spans(tmp_path):
    async def scenario(client, state):
        frames = []
        async with client.ws_connect("/admin/telemetry") as ws:
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                frames.append(orjson.loads((await ws.receive()).data))
                kinds = {f["type"] for f in frames}
                if {"hello", "snapshot", "spans"} <= kinds and any(
                        f["type"] == "snapshot" and f["requests"]["finished"] for f in frames):
                    break
        return frames
    frames = run_app(gateway_config(tmp_path), scenario, in_memory=False)
    assert frames[0]["type"] == "hello" and frames[0]["prices"]["name"] == "seed"
    snap = [f for f in frames if f["type"] == "snapshot"][-1]
    worker = snap["workers"][0]
    assert worker["alive"] and worker["utilisation_source"] == "busy-fraction"
    assert snap["revenue"]["total"]["total"] > 0 and snap["tenants"][0]["tenant"] == "default"
    spans = [s for f in frames if f["type"] == "spans"
             for rs in f["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    root = next(s for s in spans if s["name"] == "llm.request")
    assert len(root["traceId"]) == 32 and root["parentSpanId"] == ""
    assert {a["key"] for a in root["attributes"]} >= {"tenant", "cost.total", "cached_tokens"}


def test_otlp_export_reaches_a_collector(tmp_path):
    received = {"/v1/traces": 0, "/v1/metrics": 0}

    async def collect(request):
        received[request.path] += 1
        await request.read()
        return web.Response(status=200)

    async def main():
        collector = web.Application()
        collector.router.add_post("/v1/traces", collect)
        collector.router.add_post("/v1/metrics", collect)
        async with TestServer(collector) as server:
            endpoint = f"http://127.0.0.1:{server.port}"
            config = gateway_config(tmp_path, otlp_endpoint=endpoint, otlp_interval_seconds=0.3)
            app = create_app(config)
            async with TestClient(TestServer(app)) as client:
                await ready(client)
                await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                for _ in range(100):
                    if received["/v1/metrics"]:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(app[STATE].telemetry.provider.force_flush)
    asyncio.run(main())
    assert received["/v1/traces"] >= 1 and received["/v1/metrics"] >= 1


def test_slow_feed_consumer_is_dropped_not_waited_on():
    async def main():
        hub = FeedHub()
        slow, fast = hub.subscribe(), hub.subscribe()
        for i in range(300):
            hub.publish({"type": "snapshot", "i": i})
            while not fast.queue.empty():
                fast.queue.get_nowait()
        return hub, slow, fast
    hub, slow, fast = asyncio.run(main())
    assert slow.dropped and slow not in hub.subscribers
    assert not fast.dropped and fast in hub.subscribers


def test_worker_counters_grow_by_what_the_totals_grew_and_survive_restarts():
    from prometheus_client import CollectorRegistry

    from gateway.telemetry.metrics import WorkerCounter
    registry = CollectorRegistry()
    hits = WorkerCounter("vllm:prefix_cache_hits", "hits", ["model_name"], registry)
    for total in (0, 16, 48, 48, 8, 24):  # the worker restarted after 48: it counts from 0
        hits.follow(("m", "0"), total)
    hits.follow(("m", "1"), 5)
    value = registry.get_sample_value
    assert value("vllm:prefix_cache_hits_total", {"model_name": "m", "worker": "0"}) == 72
    assert value("vllm:prefix_cache_hits_total", {"model_name": "m", "worker": "1"}) == 5
