"""Multi-byte output: a character made of several byte tokens reaches the client as one stream
message once it is whole, so a message can carry two tokens or more. The load tester counts
output tokens from the server's usage, times them per token (an arrival's gap split over the
tokens it carried), and counts one per message only as a labelled estimate when a server
reports no usage; in no case is that called a mismatch.

Against a scripted aiohttp server (tests/loadtest/broken_server.py: one message carries the
two tokens of one emoji, and the usage says 4 tokens in 3 messages), and against the real
gateway serving the tiny model, whose grammar (guided_choice) forces CJK and emoji output.
"""
import asyncio
import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from loadtest.dists import Dist
from loadtest.mix import Mix
from loadtest.report import print_report
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load
from loadtest.workloads import WorkloadParams
from testkit.gateway_server import GatewayProcess
from tests.loadtest.test_broken_server import run as run_scripted
from tests.loadtest.test_broken_server import write_trace

# every character here is one token of no vocabulary: a byte-level tokenizer spells it in bytes
CHOICE = "日本語 🙂 café 👍🏽 東京"
GUIDED = {"guided_choice": [CHOICE], "jump_forward": False}  # one token per engine step


def report_text(result: dict, width: int = 80) -> str:
    buf = io.StringIO()
    print_report(result, Console(file=buf, width=width))
    return buf.getvalue()


@pytest.mark.parametrize("protocol", ["sse", "ws"])
def test_two_token_message_counted_from_usage(tmp_path, protocol):
    result, out = run_scripted(write_trace(tmp_path / "t.jsonl", ["mb"]), protocol=protocol)
    for r in out.records:
        assert r.ok and r.count_source == "usage" and not r.usage_mismatch
        assert [n for _, n in r.chunks] == [1, 2, 1]  # the emoji's message carries two
        assert r.tokens_arrived == r.completion_tokens == 4
        (t1, _), (t2, _), (t3, _) = r.chunks
        assert r.chunk_gaps() == pytest.approx([t2 - t1, t3 - t2])  # one gap per arrival
        # per token: the emoji's gap split over its two tokens, tokens - 1 gaps in all
        assert r.itls() == pytest.approx([(t2 - t1) / 2, (t2 - t1) / 2, t3 - t2])
        assert r.tpot == pytest.approx((t3 - t1) / 3)
    tok = result["summary"]["tokens"]
    assert tok["usage_mismatch_requests"] == 0 and tok["counted_from"] == {"usage": 2}
    assert tok["completion"] == tok["completion_reported"] == 8 and tok["messages"] == 6
    lat = result["summary"]["latency_ms"]
    assert lat["itl"]["count"] == 6 and lat["chunk_gap"]["count"] == 4
    text = report_text(result)
    assert "8 (2 requests from the server's usage)" in text
    assert "mismatch" not in text and "contradicts" not in text


def test_without_usage_tokens_are_an_estimate_not_a_mismatch(tmp_path):
    result, out = run_scripted(write_trace(tmp_path / "t.jsonl", ["mb_nousage"]))
    assert all(r.ok and r.count_source == "chunks" and r.tokens_arrived == 3
               for r in out.records)
    tok = result["summary"]["tokens"]
    assert tok["usage_mismatch_requests"] == 0 and tok["requests_without_usage"] == 2
    text = report_text(result)
    assert "estimated from chunks" in text and "2 requests reported none" in text
    assert "mismatch" not in text and "contradicts" not in text


@pytest.fixture(scope="module")
def gw(tiny_model_dir):
    server = GatewayProcess("--model", str(tiny_model_dir), "--kv-cache-gb", "0.01")
    yield server
    server.stop()


def run_gateway(gw, protocol: str, count_mode: str = "usage"):
    params = WorkloadParams(input_len=Dist.parse(4), output_len=Dist.parse(64))
    st = Settings(gw.url, "random", LoadShape(concurrency=2, requests=6), params,
                  Mix.default(), protocol=protocol, count_mode=count_mode, extra_body=GUIDED)
    return asyncio.run(run_load(st))


@pytest.mark.parametrize("protocol", ["sse", "ws", "http"])
def test_gateway_multibyte_output_reports_no_mismatch(gw, protocol):
    result, out = run_gateway(gw, protocol)
    s = result["summary"]
    assert s["requests"]["completed"] == 6, s["requests"]
    tok = s["tokens"]
    assert tok["usage_mismatch_requests"] == 0 and tok["counted_from"] == {"usage": 6}
    assert tok["completion"] == tok["completion_reported"] == tok["completion_arrived"]
    for r in out.records:
        assert r.output_chars == len(CHOICE)
        assert r.tokens_arrived == r.completion_tokens > len(CHOICE)  # bytes, and the end
        if protocol == "http":
            continue
        assert len(r.chunks) < r.completion_tokens  # some messages carried several tokens
        first, last = r.chunks[0][0], r.chunks[-1][0]
        assert len(r.itls()) == r.completion_tokens - 1
        assert r.tpot == pytest.approx((last - first) / (r.completion_tokens - 1))
        assert len(r.chunk_gaps()) == len(r.chunks) - 1


def test_gateway_counted_per_message_is_an_estimate(gw):
    result, out = run_gateway(gw, "sse", count_mode="chunks")
    tok = result["summary"]["tokens"]
    assert tok["usage_mismatch_requests"] == 0 and tok["counted_from"] == {"chunks": 6}
    assert tok["completion"] == tok["completion_reported"] > tok["completion_arrived"]
    assert "estimated from chunks" in report_text(result)


def test_cli_against_gateway_says_no_mismatch(gw, tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "--url", gw.url, "--workload", "random",
         "--input-len", "4", "--output-len", "64", "--concurrency", "2", "--requests", "4",
         "--extra-body", json.dumps(GUIDED), "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=True)
    # a pipe: rich's 80 columns, and still every figure whole
    assert "from the server's usage" in done.stdout
    assert "mismatch" not in done.stdout and "…" not in done.stdout
    doc = json.loads(out.read_text())
    assert doc["summary"]["tokens"]["usage_mismatch_requests"] == 0
    assert doc["run"]["count_tokens"] == "usage"
