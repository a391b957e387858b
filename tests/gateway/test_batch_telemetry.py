"""The batch tier seen from outside, on a fake-engine gateway: a batch run through the openai
client next to online requests is billed at half price, counted apart in /admin/usage, in
the tier's /metrics revenue, and in the live feed's `tiers` (busy seconds and revenue by tier,
no lines left once it is done)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from bench.batch_tier import feed_snapshot
from testkit.gateway_server import GatewayProcess
from tests.gateway.batch_helpers import line, run_batch

pytestmark = [pytest.mark.subprocess]

PROMPT = "Say something about the sea"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-telemetry")
    server = GatewayProcess("--fake", "--fake-step-ms", "5", "--max-num-seqs", "4",
                            "--prices", "seed", "--ledger-path", str(tmp / "ledger.sqlite3"))
    server.admin_key = None
    yield server
    server.stop()


def get_json(gw, path: str) -> dict:
    with urllib.request.urlopen(gw.url + path, timeout=30) as r:
        return json.load(r)


def test_a_batch_is_billed_and_shown_apart_from_online_work(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0}
    online = client.chat.completions.create(model="fake-smollm2", **body)
    batch, out, errors = run_batch(client, "/v1/chat/completions",
                                   [line(f"l{i}", "/v1/chat/completions", body)
                                    for i in range(6)])
    assert batch.status == "completed" and len(out) == 6 and not errors
    # a batch line is billed at the seed prices times the batch multiplier (0.5), whatever
    # of its prompt the cache held
    costs = []
    for entry in out.values():
        u = entry["response"]["body"]["usage"]
        hit = u["prompt_tokens_details"]["cached_tokens"]
        expected = (hit * 0.003 + (u["prompt_tokens"] - hit) * 0.15
                    + u["completion_tokens"] * 0.60) / 1e6 * 0.5
        assert u["cost"]["total"] == pytest.approx(expected, rel=1e-9)
        costs.append(u["cost"]["total"])
    online_cost = online.usage.model_dump()["cost"]["total"]
    u = online.usage
    assert online_cost == pytest.approx((u.prompt_tokens * 0.15 + u.completion_tokens * 0.60)
                                        / 1e6, rel=1e-9)  # the first: nothing cached, 1x
    batch_cost = sum(costs)

    (usage,) = get_json(gw, "/admin/usage?period=all")["data"]
    assert (usage["requests"], usage["batch_requests"]) == (7, 6)
    assert usage["cost_batch"] == pytest.approx(batch_cost, rel=1e-9)

    metrics = gw.get("/metrics")[1].decode()
    batch_revenue = [float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                     if x.startswith("inferstack:tier_revenue_usd_total{") and 'tier="batch"' in x]
    assert batch_revenue == [pytest.approx(batch_cost, rel=1e-9)]

    tiers = asyncio.run(feed_snapshot(gw.url))["tiers"]
    assert tiers["batch_enabled"] is True
    assert (tiers["lines_waiting"], tiers["lines_running"]) == (0, 0)
    assert tiers["busy_seconds"]["batch"] > 0 and tiers["busy_seconds"]["online"] > 0
    assert tiers["revenue"]["batch"] == pytest.approx(batch_cost, rel=1e-9)
