"""A real Prometheus server scrapes a fake-engine gateway with a metrics key, and PromQL answers
what the gateway's own /metrics says: the running gauge while streams are held open and after
they end, and histogram quantiles of TTFT and ITL interpolated from the same buckets."""
from __future__ import annotations

import asyncio
import math
import os
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.services import prometheus
from testkit.services.prometheus import scraped_gateway, services_held_back
from tests.gateway.keyfile import write_key_file

METRICS_KEY = "sk-scraper"  # `metrics = true` and not an admin: /metrics, nothing more
KEYS = [("sk-alpha", "alpha", False, False), (METRICS_KEY, "ops", False, False, True)]
RUNNING = "vllm:num_requests_running"
STEP_MS = 20  # a held stream of 400 tokens runs 8 s: longer than the checks need


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prom")
    keys = write_key_file(tmp / "keys.toml", {"alpha": {}, "ops": {}}, KEYS)
    with scraped_gateway(tmp, METRICS_KEY, "--fake", "--fake-step-ms", str(STEP_MS),
                         "--max-num-seqs", "4", "--keys-file", keys,
                         "--ledger-path", str(tmp / "ledger.sqlite3")) as pair:
        yield pair


@pytest.fixture(scope="module")
def gw(stack):
    return stack[0]


@pytest.fixture(scope="module")
def prom(stack):
    return stack[1]


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def open_stream(session: aiohttp.ClientSession, url: str, max_tokens: int):
    """A streamed completion that has sent its first token; the caller closes it."""
    body = {"prompt": "hold this stream open", "max_tokens": max_tokens, "stream": True}
    resp = await session.post(url + "/v1/completions", json=body,
                              headers={"Authorization": "Bearer sk-alpha"})
    assert resp.status == 200, await resp.text()
    line = b""
    while not line.startswith(b"data: {"):
        line = await resp.content.readline()
        assert line, "the stream ended before its first token"
    return resp


async def finish_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> None:
    async with session.post(url + "/v1/completions",
                            json={"prompt": "a short one", "max_tokens": max_tokens,
                                  "stream": True},
                            headers={"Authorization": "Bearer sk-alpha"}) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


def running_agrees(gw, prom, expected: int) -> tuple[float, float, float]:
    """Once the gateway shows `expected`, wait for a scrape that began after that, then read
    PromQL and the gateway again: (gateway before, PromQL, gateway after)."""
    wait_until(lambda: gw.metric(RUNNING) == expected, what=f"{RUNNING} == {expected}")
    before = gw.metric(RUNNING)
    prom.api.wait_for_scrape(after=time.time())
    return before, prom.api.value(RUNNING), gw.metric(RUNNING)


def test_running_requests_match_the_gateway(gw, prom):
    async def main():
        async with aiohttp.ClientSession() as s:
            streams = [await open_stream(s, gw.url, 400) for _ in range(3)]
            held = await asyncio.to_thread(running_agrees, gw, prom, 3)
            for resp in streams:  # leaving aborts them everywhere
                resp.close()
            ended = await asyncio.to_thread(running_agrees, gw, prom, 0)
            return held, ended
    held, ended = asyncio.run(main())
    assert held == (3, 3, 3)
    assert ended == (0, 0, 0)


# ---- histogram quantiles ----------------------------------------------------------------------
def bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's histogram_quantile over cumulative buckets (upper bound -> count): find the
    bucket holding rank q * total and interpolate linearly inside it; the first bucket starts
    at 0, and a rank in +Inf answers the highest finite bound."""
    bounds = sorted(buckets)
    counts = [buckets[le] for le in bounds]
    assert bounds[-1] == math.inf and len(bounds) >= 2
    rank = q * counts[-1]
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, below = (bounds[b - 1], counts[b - 1]) if b > 0 else (0.0, 0.0)
    return start + (bounds[b] - start) * ((rank - below) / (counts[b] - below))


def gateway_buckets(gw, family: str) -> dict[float, float]:
    """The family's `_bucket` samples from the gateway's /metrics, summed by `le`."""
    text = gw.get("/metrics", METRICS_KEY)[1].decode()
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == family + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def finished_traffic(gw, prom):
    """16 streams through 4 slots: four waves, so TTFTs spread over several buckets."""
    before = gw.metric("vllm:time_to_first_token_seconds_count")

    async def main():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(finish_stream(s, gw.url, 6 + i % 5) for i in range(16)))
    asyncio.run(main())
    wait_until(lambda: gw.metric("vllm:time_to_first_token_seconds_count") >= before + 16,
               what="16 settled requests")


@pytest.mark.parametrize("family", ["vllm:time_to_first_token_seconds",
                                    "vllm:inter_token_latency_seconds"])
@pytest.mark.parametrize("q", [0.5, 0.9])
def test_histogram_quantiles_match_the_gateways_buckets(gw, prom, finished_traffic, family, q):
    before = gateway_buckets(gw, family)
    prom.api.wait_for_scrape(after=time.time())
    promql = prom.api.value(f"histogram_quantile({q}, sum by (le) ({family}_bucket))")
    after = gateway_buckets(gw, family)
    assert before == after, "the histogram moved while it was being compared"
    expected = bucket_quantile(q, after)
    assert math.isfinite(expected) and expected > 0
    assert promql == pytest.approx(expected, rel=1e-12, abs=0)


def test_quantiles_spread_over_buckets(gw, finished_traffic):
    """The comparison above means something only if the observations are not all in one
    bucket: the waves queue behind each other."""
    ttft = gateway_buckets(gw, "vllm:time_to_first_token_seconds")
    filled = {le for le, n in ttft.items() if 0 < n < ttft[math.inf]}
    assert len(filled) >= 2, ttft


def test_bucket_quantile_follows_prometheus_rules():
    buckets = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, math.inf: 10.0}
    assert bucket_quantile(0.1, buckets) == pytest.approx(0.05)  # inside the first, from 0
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert bucket_quantile(0.99, buckets) == 1.0  # in +Inf: the highest finite bound


# ---- installing without a running service -----------------------------------------------------
@pytest.fixture
def policy(tmp_path, monkeypatch):
    path = tmp_path / "policy-rc.d"
    monkeypatch.setattr(prometheus, "POLICY_RC", path)
    return path


def write_policy(path, code: int) -> None:
    path.write_text(f"#!/bin/sh\nexit {code}\n")
    os.chmod(path, 0o755)


def test_install_refuses_services_only_while_it_runs(policy):
    with services_held_back():
        assert os.access(policy, os.X_OK) and policy.read_text().endswith("exit 101\n")
    assert not policy.exists()


def test_install_sets_another_policy_aside_and_puts_it_back(policy):
    write_policy(policy, 0)
    with services_held_back():
        assert policy.read_text() == prometheus.REFUSE_ALL
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert [p.name for p in policy.parent.iterdir()] == ["policy-rc.d"]


def test_install_leaves_a_refusing_policy_alone(policy):
    write_policy(policy, 101)
    mtime = policy.stat().st_mtime_ns
    with services_held_back():
        assert policy.read_text() == "#!/bin/sh\nexit 101\n"
    assert policy.stat().st_mtime_ns == mtime
