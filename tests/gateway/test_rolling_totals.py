"""The live snapshot's recent amounts: exact window sums, and memory bounded by time, not by
the request rate."""
from __future__ import annotations

import pytest

from gateway.telemetry.rolling_totals import MAX_LATENCY_SAMPLES, WINDOW_SECONDS, RollingTotals
from numeric.percentiles import percentile


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_window_sums_count_each_request_once():
    clock = Clock()
    r = RollingTotals(clock)
    r.add(10, 5, 0.25, 0.1, 0.01)
    r.add(1, 2, 0.5, None, None)  # same second: same bucket
    clock.now += 30
    r.add(100, 0, 1.0, 0.2, 0.02)
    assert r.sums(60) == (111, 7, pytest.approx(1.75))
    assert r.sums(10) == (100, 0, pytest.approx(1.0))
    clock.now += 45  # the first two are now 75 s old
    assert r.sums(60) == (100, 0, pytest.approx(1.0))
    assert r.sums(3600) == (111, 7, pytest.approx(1.75))


def test_an_hour_of_heavy_traffic_keeps_an_hour_of_buckets():
    clock = Clock()
    r = RollingTotals(clock)
    for _ in range(2 * WINDOW_SECONDS):  # two hours, 50 requests a second
        for _ in range(50):
            r.add(1, 1, 0.001, 0.05, 0.01)
        clock.now += 1
    assert len(r.buckets) <= WINDOW_SECONDS
    assert len(r.latencies) == MAX_LATENCY_SAMPLES
    hit, miss, dollars = r.sums(3600)
    assert hit == miss == 50 * 3600 and dollars == pytest.approx(180.0)


def test_latencies_are_the_newest_of_the_last_five_minutes():
    clock = Clock()
    r = RollingTotals(clock)
    r.add(0, 0, 0.0, 9.0, 9.0)  # an old slow request
    clock.now += 301
    for i in range(100):
        r.add(0, 0, 0.0, i / 100, None if i % 2 else i / 1000)
    ttft, itl = r.recent_latencies()
    assert len(ttft) == 100 and max(ttft) < 1.0  # the 301 s old one is out
    assert len(itl) == 50
    assert percentile(ttft, 50) == pytest.approx(0.495)  # between 0.49 and 0.50
