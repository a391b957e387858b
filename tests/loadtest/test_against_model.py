"""Briefly against the real model (slow on CPU: a handful of requests)."""
import asyncio

import pytest

from loadtest.dists import Dist
from loadtest.mix import Mix
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load
from loadtest.workloads import WorkloadParams
from testkit.gateway_server import GatewayProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--kv-cache-gb", "0.25")
    yield server
    server.stop()


def test_shared_prefix_on_the_real_model(gw):
    params = WorkloadParams(input_len=Dist.parse(6), output_len=Dist.parse(6), prefix_len=120)
    st = Settings(gw.url, "shared-prefix", LoadShape(concurrency=1, requests=3), params,
                  Mix.default(), seed=5)
    result, out = asyncio.run(run_load(st))
    s = result["summary"]
    assert s["requests"]["completed"] == 3, s["requests"]
    assert s["tokens"]["usage_mismatch_requests"] == 0
    assert 0 < s["latency_ms"]["ttft"]["p50"] < s["latency_ms"]["e2e"]["p50"]
    later = sorted(out.records, key=lambda r: r.sent)[1:]
    assert all(r.cached_tokens >= 0.5 * r.prompt_tokens for r in later)
    assert s["money"]["revenue"]["total"] > 0
