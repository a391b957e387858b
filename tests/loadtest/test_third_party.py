"""NVIDIA's AIPerf, unchanged, against a fake-engine gateway, and our load tester on the same
workload against the same gateway: AIPerf's JSON report is complete and error-free, its token
counts (made with the tokenizer `python -m runtime export-tokenizer` wrote, nothing downloaded)
equal the gateway's usage, and the two tools' figures agree.

The fake engine's timing is known: every step sleeps S and then gives each running request one
token. So both tools must see a token every S (TPOT ~ S), a first token after one or two steps,
and at most C tokens per S overall. Where they may differ, and by how much:
  - TPOT: by 20% of S. Both time the engine's step cadence; what differs is per-message
    client work (microseconds), far below one step.
  - TTFT p50: by S + 10 ms. Where a request lands in the engine's step cycle is arbitrary,
    so a run's first tokens shift by up to one step; AIPerf also starts its clock before
    opening a connection.
  - e2e p50 by 15%, output tokens/s by 25%: both are closed loops of C users, but AIPerf
    hands each next request to a worker over ZMQ, and its dozen processes share the two
    cores with the gateway. That costs it tens of milliseconds a request on a loaded machine:
    at 25 ms a step AIPerf measured 5-16% fewer tokens/s than ours, at 50 ms within 1%.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from runtime.loading.loader import default_model_path
from runtime.loading.tokenizer_export import read_gguf_source, write_folder
from testkit.gateway_server import GatewayProcess
from tests.loadtest.peer_aiperf import (
    INSTALL_HINT,
    Workload,
    aiperf_command,
    aiperf_figures,
    find_aiperf,
    no_download_env,
    ours_command,
    ours_figures,
    read_report,
    side_by_side,
)

S = 0.050  # fake engine step, seconds: long beside AIPerf's per-request overhead
W = Workload(requests=20, concurrency=4, prompt_tokens=62, output_tokens=16)
GATEWAY_COUNTERS = ["vllm:request_success_total", "vllm:prompt_tokens_total",
                    "vllm:generation_tokens_total"]


@pytest.fixture(scope="module")
def aiperf() -> str:
    exe = find_aiperf()
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return exe


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--fake", "--fake-step-ms", str(S * 1000))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2():
    return read_gguf_source(default_model_path())


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2, tmp_path_factory) -> str:
    """What `python -m runtime export-tokenizer DIR` writes (tested in
    tests/runtime/test_tokenizer_export.py), written in process to save a start-up."""
    folder = str(tmp_path_factory.mktemp("peers") / "tokenizer")
    write_folder(smollm2, folder)
    return folder


def template_tokens(source) -> int:
    """Tokens the chat template adds around one user message (SmolLM2 adds a system turn)."""
    tok = source.tokenizer
    return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": ""}])))


def counters(gw) -> dict[str, float]:
    return gw.metrics(GATEWAY_COUNTERS)


@pytest.fixture(scope="module")
def runs(aiperf, gw, smollm2, tokenizer_dir, tmp_path_factory):
    """AIPerf, then ours, on one workload; the gateway's counters around AIPerf's run."""
    base = tmp_path_factory.mktemp("runs")
    model = json.loads(gw.get("/v1/models")[1])["data"][0]["id"]
    hf_home = base / "hf-home"
    before = counters(gw)
    done = subprocess.run(aiperf_command(aiperf, gw.url, model, tokenizer_dir, W,
                                         str(base / "aiperf")),
                          env=no_download_env(str(hf_home)), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    after = counters(gw)
    subprocess.run(ours_command(gw.url, W, template_tokens(smollm2), str(base / "ours.json")),
                   check=True, capture_output=True, timeout=120)
    report, records = read_report(str(base / "aiperf"))
    result = json.loads((base / "ours.json").read_text())
    print(side_by_side(aiperf_figures(report), ours_figures(result)))  # shown with -s
    return {"report": report, "records": records, "ours": result, "hf_home": hf_home,
            "served": {k: after[k] - before[k] for k in GATEWAY_COUNTERS}}


def test_aiperf_report_is_complete_and_error_free(runs):
    report = runs["report"]
    assert report["is_complete"] and not report["was_cancelled"]
    assert not report["error_summary"] and report["request_error_rate"]["avg"] == 0
    assert report["request_count"]["avg"] == W.requests == len(runs["records"])
    assert runs["served"]["vllm:request_success_total"] == W.requests


def test_aiperf_token_counts_equal_the_gateways_usage(runs):
    # output: AIPerf re-tokenizes the streamed text with the exported tokenizer
    for rec in runs["records"]:
        m = rec["metrics"]
        assert m["output_sequence_length"]["value"] == m["usage_completion_tokens"]["value"] \
            == W.output_tokens
        # prompt: AIPerf sized the templated prompt with the exported tokenizer and template;
        # the gateway, tokenizing with its own, counts the same
        assert m["usage_prompt_tokens"]["value"] == W.prompt_tokens
    report, served = runs["report"], runs["served"]
    assert report["total_osl"]["avg"] == served["vllm:generation_tokens_total"] \
        == W.requests * W.output_tokens
    assert report["total_usage_prompt_tokens"]["avg"] == served["vllm:prompt_tokens_total"]


def test_aiperf_downloaded_nothing(runs):
    # its Hugging Face home (the Hub cache) holds no file: the tokenizer came from the folder
    assert not [p for p in runs["hf_home"].rglob("*") if p.is_file()]


def test_aiperf_latencies_follow_the_engine_timing(runs):
    a = aiperf_figures(runs["report"])
    ms = S * 1000
    assert 0.9 * ms <= a["tpot_mean_ms"] <= 1.5 * ms + 3
    assert 0.5 * ms <= a["ttft_p50_ms"] <= 3 * ms + 15
    assert 0.5 * W.concurrency / S <= a["output_tokens_per_s"] <= 1.1 * W.concurrency / S


def test_ours_agrees_with_aiperf(runs):
    a, o = aiperf_figures(runs["report"]), ours_figures(runs["ours"])
    ms = S * 1000
    assert o["requests"] == a["requests"] and o["errors"] == a["errors"] == 0
    assert o["output_tokens"] == a["output_tokens"]
    assert runs["ours"]["summary"]["tokens"]["usage_mismatch_requests"] == 0
    assert abs(o["prompt_tokens"] - a["prompt_tokens"]) <= 0.1 * a["prompt_tokens"]
    assert abs(o["tpot_mean_ms"] - a["tpot_mean_ms"]) <= 0.2 * ms
    assert abs(o["ttft_p50_ms"] - a["ttft_p50_ms"]) <= ms + 10
    assert o["e2e_p50_ms"] == pytest.approx(a["e2e_p50_ms"], rel=0.15)
    assert o["output_tokens_per_s"] == pytest.approx(a["output_tokens_per_s"], rel=0.25)
