"""The one percentile: exact values and edges, each caller's empty answer, and the console's
p99 (the gateway's live feed) equal to the load tester's p99 of the same latencies."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from billing.pricing import ZERO_COST
from billing.request_finished import RequestFinished
from console.state import ConsoleState
from gateway.telemetry.snapshot import SnapshotBuilder
from loadtest.figures import _median
from loadtest.stats import summarize
from numeric.percentiles import percentile


def test_exact_values_on_small_lists():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5  # rank 1.5
    assert percentile(xs, 25) == 1.75  # rank 0.75
    assert percentile(xs, 100 / 3) == pytest.approx(2.0)  # rank 1: a value itself
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile([0.0, 10.0, 20.0], 75) == 15.0  # rank 1.5


def test_order_of_the_input_does_not_matter():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile((x for x in [3.0, 1.0, 2.0]), 100) == 3.0  # any iterable


def test_edges():
    xs = [3.0, 1.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 3.0
    assert percentile([5.0], 0) == percentile([5.0], 99.9) == percentile([5.0], 100) == 5.0
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 0))
    for bad in (-0.1, 100.1, 101):
        with pytest.raises(ValueError):
            percentile(xs, bad)


def test_matches_numpy_linear():
    rng = random.Random(3)
    for n in (1, 2, 7, 100, 1001):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)


def test_each_caller_keeps_its_empty_answer():
    assert SnapshotBuilder(state=None)._latency() == {  # the feed (JSON): null
        "ttft_p50": None, "ttft_p99": None, "itl_p50": None, "itl_p99": None}
    assert summarize([])["p99"] is None and _median([]) is None  # load tester's JSON: null
    assert math.isnan(percentile([], 99))  # the function itself (and the benchmarks): NaN


def _settled(ttft: float, finished: float) -> RequestFinished:
    """A settled request as the accounting hands it to the snapshot: TTFT from its enqueue
    and first-token times, ITL from the worker's timing (first token at 1 s, finished at
    `finished`) over two output tokens."""
    return RequestFinished("r", "t", "k", "m", 0, "ok", 10, 4, 2, ZERO_COST, 1.0, ("length",),
                           0.0, 0.0, ttft, 5.0, 0, "cpu", None,
                           {"first_token": 1.0, "finished": finished})


def test_console_and_load_tester_agree_on_the_same_latencies():
    rng = random.Random(11)
    ttfts = [rng.lognormvariate(-2, 1) for _ in range(997)]
    finishes = [1.0 + rng.lognormvariate(-4, 0.5) for _ in range(997)]
    itls = [f - 1.0 for f in finishes]  # what the load tester would measure of each
    builder = SnapshotBuilder(state=None)
    for t, f in zip(ttfts, finishes):
        builder.on_settled(_settled(t, f))
    # the gateway's live feed, over the wire, folded by the console
    console = ConsoleState()
    console.apply(json.loads(json.dumps({"type": "snapshot", "latency": builder._latency()})))
    shown = console.queue_view()
    # the load tester's summaries of the same latencies
    ttft_s, itl_s = summarize(ttfts), summarize(itls)
    assert (shown.ttft_p50, shown.ttft_p99) == (ttft_s["p50"], ttft_s["p99"])
    assert (shown.itl_p50, shown.itl_p99) == (itl_s["p50"], itl_s["p99"])
    assert summarize(ttfts, scale=1000.0)["p99"] == pytest.approx(1000 * shown.ttft_p99,
                                                                  rel=1e-12)  # its ms figure
    # the feed's former nearest-rank pick would have shown a different p99 here
    ordered = sorted(ttfts)
    assert ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] != shown.ttft_p99
