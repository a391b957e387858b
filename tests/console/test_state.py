"""The console's pure parts: formatting, folding frames into views, spans, record and replay."""
from __future__ import annotations

import asyncio
import json

import pytest

from console import fmt
from console.feed import (
    Frame,
    Malformed,
    Recorder,
    ReplayFeed,
    Status,
    decode,
    feed_url,
    read_recording,
)
from console.spans import TraceBook
from console.state import ConsoleState, annual_projection, margin
from tests.console.conftest import FEED

HELLO = {"type": "hello", "model": "m", "workers": 2, "started_at": 1.0,
         "prices": {"name": "seed", "gpu_cost_per_hour": 2.0}}


def snapshot(**over) -> dict:
    frame = {"type": "snapshot", "time": 10.0, "uptime_s": 65.0,
             "workers": [{"index": 0, "device": "cuda:0", "utilisation": 0.5, "kv_usage": 0.25,
                          "memory_used_bytes": 2**30, "memory_total_bytes": 8 * 2**30,
                          "running": 3, "waiting": 1, "tokens_per_s": 50.0}],
             "queue": {"length": 3, "by_priority": {"10": 1, "2": 2}},
             "cache": {"hit_tokens": 300, "miss_tokens": 100, "hit_rate": 0.75,
                       "hit_rate_last_minute": 0.8},
             "revenue": {"total": {"cache_hit_input": 1.0, "cache_miss_input": 2.0,
                                   "output": 7.0, "total": 10.0},
                         "last_minute": 0.5, "last_hour": 10.0, "per_gpu_hour": 3.0,
                         "gpu_cost_per_hour": 2.0, "gpus": 1},
             "latency": {"ttft_p50": 0.2, "ttft_p99": None, "itl_p50": 0.04, "itl_p99": 0.09},
             "requests": {"finished": 5, "running": 3},
             "tenants": [{"tenant": "a", "spend": 1.0}, {"tenant": "b", "spend": 9.0}]}
    frame.update(over)
    return frame


def spans_frame(trace_id: str, *spans: tuple[str, str, str, int, int, dict]) -> dict:
    def attr(k, v):
        kind = {str: "stringValue", int: "intValue", float: "doubleValue"}[type(v)]
        return {"key": k, "value": {kind: str(v) if kind == "intValue" else v}}
    return {"type": "spans", "resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [
        {"scope": {"name": "t"}, "spans": [
            {"traceId": trace_id, "spanId": sid, "parentSpanId": parent, "name": name,
             "startTimeUnixNano": str(a), "endTimeUnixNano": str(b),
             "attributes": [attr(k, v) for k, v in attrs.items()], "status": {"code": 1}}
            for sid, parent, name, a, b, attrs in spans]}]}]}


@pytest.mark.parametrize("x, text", [
    (0, "$0"), (0.000123, "$0.000123"), (1.54e-5, "$0.0000154"), (0.018, "$0.018"),
    (2, "$2.00"), (12.345, "$12.35"), (20183.2, "$20,183"), (4.03e7, "$40.3M"),
    (-0.5, "-$0.500"), (2.5e9, "$2.5B")])
def test_money_is_readable_at_every_scale(x, text):
    assert fmt.money(x) == text


def test_sparkline_scales_and_keeps_newest_right():
    assert fmt.sparkline([0.0, 0.5, 1.0], 5, 0.0, 1.0) == "  ▁▅█"
    assert fmt.sparkline(range(20), 4, 0, 19) == "▇▇██"
    assert fmt.sparkline([], 3) == "   "


def test_margin_and_annual_projection():
    assert margin(3.0, 2.0) == pytest.approx(0.5)
    assert margin(1.0, 0.0) is None
    assert annual_projection(38.0, 128) == pytest.approx(38.0 * 128 * 8760)


def test_snapshot_folds_into_views():
    state = ConsoleState(fleet_gpus=64)
    assert state.apply(HELLO) == "hello"
    for rate in (0.5, 0.6):
        state.apply(snapshot(cache={"hit_rate": 0.7, "hit_rate_last_minute": rate}))
    state.apply(snapshot())
    assert state.header_view().num_workers == 2 and state.header_view().uptime_s == 65.0
    (w,) = state.worker_views()
    assert (w.device, w.util_history, w.memory_total) == ("cuda:0", (0.5, 0.5, 0.5), 8 * 2**30)
    assert state.cache_view().history == (0.5, 0.6, 0.8)
    rev = state.revenue_view()
    assert rev.margin == pytest.approx(0.5)
    assert rev.annual == pytest.approx(3.0 * 64 * 8760)
    assert (rev.hit, rev.miss, rev.output) == (1.0, 2.0, 7.0)
    q = state.queue_view()
    assert q.by_priority == (("2", 2), ("10", 1)) and q.ttft_p99 is None
    assert [t.tenant for t in state.tenant_views()] == ["b", "a"]


@pytest.mark.parametrize("frame", [
    None, [], "text", {"no": "type"}, {"type": "unknown"}, {"type": "snapshot", "workers": 7},
    {"type": "snapshot", "queue": {"by_priority": {"0": "x"}}, "workers": [3, {"index": "z"}]},
    {"type": "spans", "resourceSpans": 5}, {"type": "spans", "resourceSpans": [{"scopeSpans":
                                          [{"spans": [{"traceId": "t", "spanId": "s"}]}]}]}])
def test_malformed_frames_are_survived(frame):
    state = ConsoleState()
    state.apply(HELLO)
    state.apply(frame)
    # every view still builds, whatever was folded in
    state.header_view(), state.worker_views(), state.cache_view(), state.revenue_view()
    state.queue_view(), state.tenant_views()
    assert state.num_frames + state.num_malformed == 2


def test_spans_group_into_traces_across_frames():
    book = TraceBook(capacity=2)
    root = ("r", "", "llm.request", 100, 900, {"request.id": "req-1", "cost.total": 0.5,
                                                "gen_ai.usage.input_tokens": 12})
    assert book.add_frame(spans_frame("t1", ("d", "r", "decode", 400, 900, {}))) == ["t1"]
    book.add_frame(spans_frame("t1", root, ("q", "r", "queue", 100, 200, {})))
    trace = book.get("t1")
    assert [s.name for s in trace.ordered()] == ["llm.request", "queue", "decode"]
    assert trace.attr("request.id") == "req-1" and trace.attr("gen_ai.usage.input_tokens") == 12
    assert trace.attr("cost.total") == 0.5 and (trace.start_ns, trace.end_ns) == (100, 900)
    book.add_frame(spans_frame("t2", root))
    book.add_frame(spans_frame("t3", root))
    assert list(book.traces) == ["t2", "t3"]  # oldest evicted


def test_model_comes_from_the_spans_when_the_hello_did_not_know_it():
    state = ConsoleState()
    state.apply({**HELLO, "model": "unknown"})
    assert state.header_view().model == "—"
    state.apply(spans_frame("t", ("r", "", "llm.request", 1, 2, {"gen_ai.request.model": "m2"})))
    assert state.header_view().model == "m2"


def test_feed_url_and_decode():
    assert feed_url("http://h:8000") == "ws://h:8000/admin/telemetry"
    assert feed_url("https://h/") == "wss://h/admin/telemetry"
    assert feed_url("ws://h:1/admin/telemetry") == "ws://h:1/admin/telemetry"
    assert feed_url("h:9") == "ws://h:9/admin/telemetry"
    assert decode('{"type": "x"}') == {"type": "x"}
    assert decode("[1]") is None and decode("{oops") is None


def test_record_then_replay_keeps_order_timing_and_bad_lines(tmp_path):
    ticks = iter([10.0, 10.5, 12.0])
    path = tmp_path / "rec.jsonl"
    rec = Recorder(path, clock=lambda: next(ticks))
    for i in range(3):
        rec.write({"type": "snapshot", "n": i})
    rec.close()
    with open(path, "a") as f:
        f.write("garbage\n")
    assert [t for t, _ in read_recording(path)] == [0.0, 0.5, 2.0, 2.0]

    now = [0.0]
    slept = []

    async def sleep(s):
        slept.append(s)
        now[0] += s

    async def play():
        feed = ReplayFeed(path, speed=2.0, sleep=sleep, clock=lambda: now[0])
        return [e async for e in feed.events()]

    events = asyncio.run(play())
    assert isinstance(events[0], Status) and events[0].state == "replaying"
    assert [e.data["n"] for e in events if isinstance(e, Frame)] == [0, 1, 2]
    assert sum(isinstance(e, Malformed) for e in events) == 1
    assert events[-1].state == "ended"
    assert slept == pytest.approx([0.25, 0.75])  # half the recorded gaps at speed 2


def test_sample_feed_is_a_real_recording_matching_the_doc():
    records = read_recording(FEED)
    frames = [f for _, f in records]
    assert all(f is not None for f in frames)
    assert frames[0]["type"] == "hello"
    kinds = {f["type"] for f in frames}
    assert kinds == {"hello", "snapshot", "spans"}
    snap = next(f for f in frames if f["type"] == "snapshot")
    assert {"workers", "queue", "cache", "revenue", "latency", "requests", "tenants"} <= set(snap)
    state = ConsoleState()
    for f in frames:
        state.apply(f)
    assert state.num_malformed == 0 and len(state.traces) > 20
    assert all(t.root is not None for t in state.traces.traces.values())
    json.dumps(frames)  # plain JSON all the way down
