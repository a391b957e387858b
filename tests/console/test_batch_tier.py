"""The batch tier in the console: folded from a snapshot's `tiers` only while the gateway runs
the tier, drawn in the queue panel (its lines waiting and running) and the revenue panel (its
revenue, per GPU-hour and the utilisation it added); a feed without it draws as before."""
from __future__ import annotations

from rich.console import Console

from console.state import ConsoleState
from console.widgets.queue_panel import QueuePanel
from console.widgets.revenue_panel import RevenuePanel
from tests.console.test_state import snapshot

TIERS = {"batch_enabled": True, "batches_open": 2, "lines_waiting": 1234, "lines_running": 6,
         "busy_seconds": {"online": 30.0, "batch": 50.0}, "busy_share_batch": 0.625,
         "utilisation_last_minute": {"online": 0.35, "batch": 0.6},
         "revenue": {"online": 7.5, "batch": 2.5}, "revenue_last_hour": {"online": 7.5,
                                                                         "batch": 2.5},
         "per_gpu_hour": {"online": 7.5, "batch": 2.5}}


def text_of(widget) -> str:
    console = Console(width=60, record=True)
    console.print(widget.render())
    return console.export_text()


def test_the_tier_view_folds_the_batch_tier():
    state = ConsoleState()
    state.apply(snapshot())
    assert state.tier_view() is None  # an older gateway, or the tier off
    state.apply(snapshot(tiers={**TIERS, "batch_enabled": False}))
    assert state.tier_view() is None
    state.apply(snapshot(tiers=TIERS))
    v = state.tier_view()
    assert (v.batches_open, v.lines_waiting, v.lines_running) == (2, 1234, 6)
    assert (v.revenue_online, v.revenue_batch, v.per_gpu_hour_batch) == (7.5, 2.5, 2.5)
    assert (v.busy_share_batch, v.util_online, v.util_batch) == (0.625, 0.35, 0.6)
    assert state.queue_view().batch == v and state.revenue_view().batch == v
    state.apply(snapshot(tiers={"batch_enabled": True, "revenue": "junk"}))
    assert state.tier_view().revenue_batch == 0.0  # malformed parts read as zero


def test_the_panels_show_the_tier_only_when_it_runs():
    state = ConsoleState()
    state.apply(snapshot())
    queue, revenue = QueuePanel(), RevenuePanel()
    queue.view, revenue.view = state.queue_view(), state.revenue_view()
    plain_queue, plain_revenue = text_of(queue), text_of(revenue)
    assert "batch" not in plain_queue and "batch" not in plain_revenue
    state.apply(snapshot(tiers=TIERS))
    queue.view, revenue.view = state.queue_view(), state.revenue_view()
    (row,) = [line.split() for line in text_of(queue).splitlines() if "batch" in line]
    assert row == ["batch", "1.2k", "wait", "6", "run"]
    shown = text_of(revenue)
    assert "batch $2.50 25%" in shown and "$2.50/GPU-h" in shown and "+60.0% busy" in shown
