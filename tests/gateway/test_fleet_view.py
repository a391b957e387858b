"""The fleet view (gateway/serving/fleet_registry.py): two fake-engine gateway processes on
one real Redis and one real PostgreSQL both appear in /admin/fleet with their workers, and in
the live feed's snapshot and on /metrics; one that is killed disappears once its TTL runs out;
fleet revenue from the shared ledger equals what both gateways billed."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess
from testkit.services.postgres import postgres_server
from testkit.services.redis import redis_server

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
TTL = 5.0  # the registry's default


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet-view")
    with postgres_server() as pg, redis_server(tmp) as rd:
        gws = []
        try:
            for i in range(2):
                gws.append(GatewayProcess(
                    "--fake", "--fake-step-ms", "5", "--workers", str(i + 1), "--prices",
                    "seed", "--ledger-path", str(tmp / f"ledger-{i}.sqlite3"),
                    "--state-url", pg.url, "--redis-url", rd.url))
            yield gws
        finally:
            for gw in gws:
                gw.stop()


def read_fleet(gw: GatewayProcess) -> dict:
    status, body = gw.get("/admin/fleet")
    assert status == 200, body
    return json.loads(body)


def by_address(view: dict) -> dict[str, dict]:
    return {g["address"]: g for g in view["gateways"]}


async def complete(session, base: str, i: int) -> None:
    body = {"model": "fake-smollm2", "prompt": f"fleet {i} " * 3, "max_tokens": 5}
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


def test_both_gateways_and_their_workers_appear(fleet):
    deadline = time.monotonic() + 30
    while True:
        views = [read_fleet(gw) for gw in fleet]
        ready = all(len(v["workers"]) == 3 and all(w["alive"] for w in v["workers"])
                    for v in views)  # a gateway is ready with its first worker
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for view in views:
        assert view["registry"] == "redis" and view["ledger"] == "shared"
        gateways = by_address(view)
        assert set(gateways) == {f"127.0.0.1:{gw.port}" for gw in fleet}
        for i, gw in enumerate(fleet):
            g = gateways[f"127.0.0.1:{gw.port}"]
            assert g["pid"] == gw.proc.pid
            assert [w["index"] for w in g["workers"]] == list(range(i + 1))
            assert all(w["alive"] and w["kind"] == "local" for w in g["workers"])
        assert len(view["workers"]) == 3


def test_fleet_revenue_is_the_sum_over_both_gateways(fleet):
    async def main():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(complete(s, gw.url, i) for i in range(6) for gw in fleet))
    asyncio.run(main())
    billed = sum(gw.metric("inferstack:revenue_usd_total") for gw in fleet)
    assert billed > 0
    for gw in fleet:
        totals = read_fleet(gw)["totals"]
        assert totals["requests"] == 12
        assert totals["cost_total"] == pytest.approx(billed, rel=1e-9)
        assert 0.0 <= totals["cache_hit_rate"] <= 1.0
    # /metrics on either gateway shows the whole fleet, read from the shared state (the
    # ledger is summed every few seconds, so wait for a reading with all twelve)
    for gw in fleet:
        deadline = time.monotonic() + 30
        while gw.metric("inferstack:fleet_requests") != 12:
            assert time.monotonic() < deadline, "the fleet totals never reached /metrics"
            time.sleep(0.5)
        assert gw.metric("inferstack:fleet_revenue_usd") == pytest.approx(billed, rel=1e-9)
        assert gw.metric("inferstack:fleet_gateways") == 2
        assert gw.metric("inferstack:fleet_workers") == 3
        assert gw.metric("inferstack:fleet_workers_alive") == 3
        assert 0.0 <= gw.metric("inferstack:fleet_cache_hit_rate") <= 1.0
        assert gw.metric("inferstack:fleet_tokens") > 0  # hit, miss and output summed


def test_the_live_feed_carries_the_fleet(fleet):
    async def main():
        async with aiohttp.ClientSession() as s, \
                s.ws_connect(fleet[0].url.replace("http", "ws") + "/admin/telemetry") as ws:
            deadline = time.monotonic() + 30
            async for msg in ws:
                frame = json.loads(msg.data)
                if frame.get("type") == "snapshot" and len(
                        frame.get("fleet", {}).get("gateways", [])) == 2:
                    return frame["fleet"]
                assert time.monotonic() < deadline, "no snapshot with the fleet"
    view = asyncio.run(main())
    assert {g["address"] for g in view["gateways"]} == {f"127.0.0.1:{gw.port}" for gw in fleet}


def test_a_killed_gateway_disappears_after_its_ttl(fleet):
    survivor, victim = fleet
    address = f"127.0.0.1:{victim.port}"
    assert address in by_address(read_fleet(survivor))
    victim.proc.kill()  # no chance to deregister: only the TTL removes it
    victim.proc.wait()
    killed_at = time.monotonic()
    while address in by_address(read_fleet(survivor)):
        assert time.monotonic() - killed_at < TTL + 10, "the dead gateway stayed"
        time.sleep(0.2)
    assert f"127.0.0.1:{survivor.port}" in by_address(read_fleet(survivor))
