"""Every way a stream can break is counted as a failure of the right kind, over SSE, WebSocket
and plain HTTP; tokens of multi-token messages are split as documented."""
import asyncio

import orjson
import pytest

from loadtest.mix import Mix
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load
from tests.loadtest import broken_server

EXPECTED_SSE = {"truncate": "truncated", "badframe": "bad_frame", "error_event": "stream_error",
                "no_finish": "truncated", "http500": "http_500", "http429": "http_429"}


def write_trace(path, modes, repeat=2):
    lines = [{"timestamp": 0.005 * i, "prompt": f"hello mode:{m}", "output_length": 4}
             for i, m in enumerate(modes * repeat)]
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    return f"trace:{path}"


def run(trace: str, **kw) -> dict:
    async def go():
        server, url = await broken_server.start()
        try:
            st = Settings(url, trace, LoadShape(**kw.pop("shape", {})), mix=Mix.default(), **kw)
            return await run_load(st)
        finally:
            await server.cleanup()
    return asyncio.run(go())


def test_sse_failures_all_counted(tmp_path):
    modes = ["ok", "lie", *EXPECTED_SSE]
    result, out = run(write_trace(tmp_path / "t.jsonl", modes))
    s = result["summary"]
    expected = {}
    for m in EXPECTED_SSE.values():
        expected[m] = expected.get(m, 0) + 2
    assert s["requests"]["errors"] == expected
    assert s["requests"]["completed"] == 4 and s["requests"]["failed"] == 12
    assert s["requests"]["status"] == {"200": 12, "500": 2, "429": 2}
    # "lie" reports 2 completion tokens where 4 messages carried text: both are flagged
    assert s["tokens"]["usage_mismatch_requests"] == 2
    assert s["tokens"]["completion_reported"] == 4 * 2 + 2 * 2
    assert s["tokens"]["completion_arrived"] == 16
    assert s["tokens"]["counted_from"] == {"usage": 2, "chunks": 2}
    assert s["cache"]["hit_rate"] == pytest.approx(4 / 10)


def test_sse_role_chunk_and_keepalive_are_not_tokens(tmp_path):
    result, out = run(write_trace(tmp_path / "t.jsonl", ["ok"], repeat=3))
    gap = broken_server.GAP
    for r in out.records:
        assert r.ok and r.tokens_arrived == 4
        # role chunk arrives one gap before the first content chunk; TTFT counts the content
        assert r.ttft >= 2 * gap * 0.9
        assert len(r.itls()) == 3 and all(0.5 * gap < g < 3 * gap for g in r.itls())


def test_multi_token_chunks_split_per_token(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", ["multi"], repeat=2)
    result, out = run(trace, count_mode="usage")
    gap = broken_server.GAP
    for r in out.records:
        assert r.ok and [n for _, n in r.chunks] == [2, 2]
        itl = r.itls()
        assert itl[0] == 0.0 and itl[1] == itl[2]  # second message's gap split in two
        assert 0.5 * gap / 2 < itl[1] < 3 * gap / 2
        assert sum(itl) == pytest.approx(r.chunks[-1][0] - r.chunks[0][0])
        assert r.tpot == pytest.approx(sum(itl) / 3)
    assert result["summary"]["tokens"]["usage_mismatch_requests"] == 0
    assert result["summary"]["tokens"]["counted_from"] == {"usage": 2}
    # counted one per message instead: an estimate, not a mismatch; the total is the usage's
    result, out = run(trace, count_mode="chunks")
    tok = result["summary"]["tokens"]
    assert tok["usage_mismatch_requests"] == 0 and tok["counted_from"] == {"chunks": 2}
    assert tok["completion"] == 8 and tok["messages"] == 4
    assert all(r.tpot == pytest.approx(r.chunks[1][0] - r.chunks[0][0]) for r in out.records)


def test_websocket_failures_all_counted(tmp_path):
    modes = ["ok", "truncate", "badframe", "error_event", "http500", "no_finish"]
    trace = write_trace(tmp_path / "t.jsonl", modes, repeat=1)
    result, _ = run(trace, protocol="ws", shape={"concurrency": 1})
    s = result["summary"]
    assert s["requests"]["completed"] == 1
    assert s["requests"]["errors"] == {"truncated": 2, "bad_frame": 1, "stream_error": 2}


def test_non_streaming_counts_usage_and_http_errors(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", ["ok", "http500"], repeat=2)
    result, out = run(trace, protocol="http")
    s = result["summary"]
    assert s["requests"]["errors"] == {"http_500": 2}
    ok = [r for r in out.records if r.ok]
    assert all(r.ttft == pytest.approx(r.e2e) and r.completion_tokens == 4 for r in ok)
    assert s["latency_ms"]["itl"]["count"] == 0 and s["latency_ms"]["tpot"]["count"] == 0


def test_unreachable_server_is_a_connection_error():
    async def go():
        st = Settings("http://127.0.0.1:9", "random", LoadShape(rate=50, requests=3),
                      model="m", mix=Mix.default())
        return await run_load(st)
    result, _ = asyncio.run(go())
    assert result["summary"]["requests"]["errors"] == {"connection": 3}
