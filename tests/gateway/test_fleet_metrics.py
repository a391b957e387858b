"""The fleet's series on /metrics (gateway/telemetry/fleet_metrics.py) from a fleet view: a
shared worker counts once however many gateways list it, a gateway that left takes its
series along, and totals appear once the ledger was summed."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry.fleet_metrics import FleetMetrics


def samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def gateway(ident: str, workers: list[dict], queue: int = 0, draining: bool = False) -> dict:
    return {"id": ident, "queue": queue, "running": len(workers), "draining": draining,
            "workers": workers}


SHARED = [{"index": 0, "url": "tcp://10.0.0.5:7000", "alive": True},
          {"index": 1, "url": "tcp://10.0.0.6:7000", "alive": False}]
LOCAL = {"index": 0, "url": None, "alive": True}


def test_shared_workers_count_once_and_totals_show():
    registry = CollectorRegistry()
    fleet = FleetMetrics("m", registry)
    fleet.refresh({"gateways": [gateway("a", SHARED + [LOCAL], queue=3),
                                gateway("b", SHARED + [LOCAL], draining=True)],
                   "read_at": 100.0,
                   "totals": {"cost_total": 1.25, "requests": 7, "cache_hit_rate": 0.5,
                              "cache_hit_tokens": 10, "cache_miss_tokens": 10,
                              "output_tokens": 4}}, now=102.5)
    s = samples(registry)
    assert s['inferstack:fleet_gateways{model_name="m"}'] == 2
    # two shared workers (one dead) and each gateway's own local one
    assert s['inferstack:fleet_workers{model_name="m"}'] == 4
    assert s['inferstack:fleet_workers_alive{model_name="m"}'] == 3
    assert s['inferstack:fleet_gateway_queue_length{gateway="a",model_name="m"}'] == 3
    assert s['inferstack:fleet_gateway_draining{gateway="b",model_name="m"}'] == 1
    assert s['inferstack:fleet_revenue_usd{model_name="m"}'] == 1.25
    assert s['inferstack:fleet_requests{model_name="m"}'] == 7
    assert s['inferstack:fleet_tokens{kind="output_tokens",model_name="m"}'] == 4
    assert s['inferstack:fleet_view_age_seconds{model_name="m"}'] == 2.5


def test_a_gateway_that_left_takes_its_series_and_no_totals_show_none():
    registry = CollectorRegistry()
    fleet = FleetMetrics("m", registry)
    fleet.refresh({"gateways": [gateway("a", [LOCAL]), gateway("b", [LOCAL])],
                   "read_at": None, "totals": None})
    fleet.refresh({"gateways": [gateway("a", [LOCAL])], "read_at": None, "totals": None})
    s = samples(registry)
    assert s['inferstack:fleet_gateways{model_name="m"}'] == 1
    assert not any('gateway="b"' in name for name in s)
    assert not any(name.startswith("inferstack:fleet_revenue_usd{") for name in s)
