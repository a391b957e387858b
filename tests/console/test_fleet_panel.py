"""The fleet panel: folded from a snapshot's `fleet` (the gateway's registry reading), drawn
only when a feed carries one, and absent from a recording made without Redis."""
from __future__ import annotations

import asyncio

import orjson
from rich.console import Console

from console.state import ConsoleState
from console.widgets.fleet_panel import FleetPanel
from tests.console.conftest import FEED, replay_app, replay_finished

FLEET = {"self": "gw-a", "read_at": 1000.0, "gateways": [
    {"id": "gw-a", "address": "10.0.0.1:8000", "heartbeat": 999.5, "queue": 2, "running": 3,
     "workers": [{"index": 0, "alive": True, "load": 0.5},
                 {"index": 1, "alive": True, "draining": True, "load": 0.25}]},
    {"id": "gw-b", "address": "10.0.0.2:8000", "heartbeat": 997.0, "queue": 0, "running": 0,
     "workers": [{"index": 0, "alive": False, "load": 0.0}]}],
    "totals": {"requests": 12, "cost_total": 0.25, "cache_hit_rate": 0.5}}


def snapshot(fleet=None) -> dict:
    frame = {"type": "snapshot", "time": 1000.0, "workers": []}
    return {**frame, "fleet": fleet} if fleet is not None else frame


def test_the_fleet_view_folds_gateways_workers_and_totals():
    state = ConsoleState()
    assert state.apply(snapshot()) == "snapshot" and state.fleet_view() is None
    state.apply(snapshot(FLEET))
    v = state.fleet_view()
    a, b = v.gateways
    assert (a.address, a.is_self, a.workers, a.alive, a.draining, a.load) == \
        ("10.0.0.1:8000", True, 2, 2, 1, 0.375)
    assert (a.queue, a.running, a.heartbeat_age_s) == (2, 3, 0.5)
    assert (b.is_self, b.alive, b.heartbeat_age_s) == (False, 0, 3.0)
    assert (v.workers, v.requests, v.revenue, v.hit_rate) == (3, 12, 0.25, 0.5)
    state.apply(snapshot({"gateways": "junk", "totals": 3}))
    assert state.fleet_view().gateways == () and state.fleet_view().revenue is None


def test_the_panel_shows_only_with_a_fleet(tmp_path):
    feed = tmp_path / "fleet.jsonl"
    feed.write_bytes(orjson.dumps({"t": 0, "frame": snapshot(FLEET)}) + b"\n")

    async def main(path, expect_shown):
        app = replay_app(path)
        async with app.run_test(size=(120, 40)) as pilot:
            await replay_finished(pilot)
            panel = app.query_one(FleetPanel)
            assert panel.display is expect_shown
            if expect_shown:
                console = Console(width=100, record=True)
                console.print(panel.render())
                text = console.export_text()
                assert "10.0.0.1:8000 (this)" in text and "10.0.0.2:8000" in text
                assert "0/1" in text and "2 gateways, 3 workers" in text
                assert "revenue" in text and "12 requests" in text
    asyncio.run(main(feed, True))
    asyncio.run(main(FEED, False))  # recorded from a gateway without --redis-url
