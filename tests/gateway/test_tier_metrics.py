"""Online and batch work apart: worker-busy seconds split by the tiers of the sequences each
worker ran, the utilisation each tier added over the last minute, the snapshot's `tiers`
frame (batch lines from the tier's view, revenue by tier) and the /metrics series."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from billing.pricing import ZERO_COST, Cost
from billing.request_finished import RequestFinished
from gateway.telemetry.metrics import GatewayMetrics, WorkerSeconds
from gateway.telemetry.snapshot import SnapshotBuilder
from gateway.telemetry.tier_usage import TierUsage, WorkerMix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_busy_seconds_are_split_by_the_running_mix():
    clock = Clock()
    usage = TierUsage(clock)
    usage.look([WorkerMix(0, 0.0, 0, 0), WorkerMix(1, 0.0, 0, 0)], 0.0)
    clock.now += 10  # worker 0: online only, busy 4 s; worker 1: all batch, busy 10 s
    usage.look([WorkerMix(0, 4.0, 0, 3), WorkerMix(1, 10.0, 2, 2)], 20.0)
    # the mix at the first look (nothing) and at this one are averaged: worker 1's 10 s
    # go half to each tier
    assert usage.busy == pytest.approx({"online": 9.0, "batch": 5.0})
    clock.now += 10  # both keep their mix: every busy second goes to its tier
    usage.look([WorkerMix(0, 8.0, 0, 3), WorkerMix(1, 20.0, 2, 2)], 40.0)
    assert usage.busy == pytest.approx({"online": 13.0, "batch": 15.0})
    clock.now += 10  # worker 1 restarted (its total starts again) with one online, one batch
    usage.look([WorkerMix(0, 8.0, 0, 0), WorkerMix(1, 6.0, 1, 2)], 60.0)
    assert usage.busy == pytest.approx({"online": 14.5, "batch": 19.5})
    assert usage.batch_share == pytest.approx(19.5 / 34.0)
    # the last minute (60 worker-seconds): online 14.5 s of it, batch 19.5 s
    assert usage.recent() == pytest.approx({"online": 14.5 / 60, "batch": 19.5 / 60})


def test_a_worker_without_statistics_is_skipped_until_it_has_some():
    usage = TierUsage(Clock())
    usage.look([WorkerMix(0, None, 1, 1)], 0.0)
    usage.look([WorkerMix(0, 5.0, 1, 1)], 1.0)  # its first total: nothing to split yet
    assert usage.busy == {"online": 0.0, "batch": 0.0}
    assert usage.recent() == {"online": 0.0, "batch": 0.0}


def finished(tier: str, dollars: float, ttft: float) -> RequestFinished:
    return RequestFinished(f"{tier}-1", "acme", "k", "m", 0, "ok", 10, 2, 5,
                           Cost(0.0, 0.0, dollars), 0.5 if tier == "batch" else 1.0,
                           ("stop",), 1.0, 1.5, 1.0 + ttft, 3.0, 0, "fake", None, None,
                           tier, "batch_1" if tier == "batch" else None)


def state(batch=None, busy=(0.0,)):
    workers = [SimpleNamespace(index=i, stats={"busy_seconds": b}) for i, b in enumerate(busy)]
    accounting = SimpleNamespace(
        before_settle=[], batch_sequences=lambda: {0: 3},
        revenue_by_tier={"online": Cost(0, 0, 2.0), "batch": Cost(0, 0, 1.0)})
    return SimpleNamespace(
        started_at=0.0, workers=workers, accounting=accounting, batch=batch,
        inflight=SimpleNamespace(slots=SimpleNamespace(on={0: {"acme": 1, "batch": 3}})),
        dispatcher=SimpleNamespace(worker_time=WorkerSeconds(1, now=0.0)))


def test_the_snapshot_shows_the_tiers_apart():
    view = SimpleNamespace(batches_open=2, lines_waiting=40, lines_running=3)
    st = state(batch=view)
    builder = SnapshotBuilder(st)
    assert st.accounting.before_settle == [builder.look_at_tiers]  # a look before each settle
    builder.on_settled(finished("online", 0.2, 0.05))
    builder.on_settled(finished("batch", 0.1, 30.0))
    builder.look_at_tiers()
    st.workers[0].stats["busy_seconds"] = 8.0  # 3 of its 4 sequences are batch lines
    frame = builder.tier_frame()
    assert frame["batch_enabled"] is True
    assert (frame["batches_open"], frame["lines_waiting"], frame["lines_running"]) == (2, 40, 3)
    assert frame["busy_seconds"] == pytest.approx({"online": 2.0, "batch": 6.0})
    assert frame["busy_share_batch"] == pytest.approx(0.75)
    assert frame["revenue"] == {"online": 2.0, "batch": 1.0}
    assert frame["revenue_last_hour"] == pytest.approx({"online": 0.2, "batch": 0.1})
    # the latency percentiles are online ones: the batch line's 30 s wait is not among them
    assert builder._latency()["ttft_p99"] == pytest.approx(0.05)
    off = SnapshotBuilder(state()).tier_frame()
    assert off["batch_enabled"] is False and off["lines_waiting"] == 0


def test_metrics_show_the_tiers_apart():
    metrics = GatewayMetrics("m")
    metrics.observe_settled(finished("online", 0.2, 0.05))
    metrics.observe_settled(finished("batch", 0.1, 30.0))
    frame = {"batches_open": 1, "lines_waiting": 7, "lines_running": 2,
             "busy_seconds": {"online": 3.0, "batch": 9.0}, "busy_share_batch": 0.75,
             "utilisation_last_minute": {"online": 0.2, "batch": 0.7}}
    metrics.refresh_tiers(frame)
    metrics.refresh_tiers(frame)  # the same totals again add nothing
    text = metrics.render().decode()
    for line in ('inferstack:tier_revenue_usd_total{model_name="m",tier="batch"} 0.1',
                 'inferstack:tier_revenue_usd_total{model_name="m",tier="online"} 0.2',
                 'inferstack:tier_requests_total{model_name="m",tier="batch"} 1.0',
                 'inferstack:worker_busy_seconds_total{model_name="m",tier="batch"} 9.0',
                 'inferstack:worker_busy_seconds_total{model_name="m",tier="online"} 3.0',
                 'inferstack:tier_utilisation{model_name="m",tier="batch"} 0.7',
                 'inferstack:batch_busy_share{model_name="m"} 0.75',
                 'inferstack:batch_lines{model_name="m",state="waiting"} 7.0',
                 'inferstack:batch_lines{model_name="m",state="running"} 2.0',
                 'inferstack:batches_open{model_name="m"} 1.0',
                 # the TTFT histogram counts the online request only
                 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0'):
        assert line in text, line
    assert ZERO_COST.total == 0
