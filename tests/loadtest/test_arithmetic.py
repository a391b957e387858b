"""Percentiles, per-token ITL, TPOT, goodput, cache-hit rate and money: exact arithmetic."""
import math
import statistics

import pytest

from loadtest.figures import figures
from loadtest.pricing import PriceBook, request_cost
from loadtest.record import RequestRecord
from loadtest.slo import SLO
from loadtest.stats import summarize
from loadtest.stream import spread_usage
from numeric.percentiles import percentile


def test_percentile_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99.9) == 5.0
    assert math.isnan(percentile([], 50))
    xs = list(range(1001))
    assert percentile(xs, 99.9) == pytest.approx(999.0)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize_matches_statistics_module():
    xs = [0.3, 0.1, 0.2, 0.9, 0.5]
    s = summarize(xs, scale=1000)
    assert s["count"] == 5 and s["min"] == 100 and s["max"] == 900
    assert s["mean"] == pytest.approx(statistics.fmean(xs) * 1000)
    assert s["std"] == pytest.approx(statistics.pstdev(xs) * 1000)
    assert s["p50"] == pytest.approx(300) and set(s) >= {"p90", "p99", "p99.9"}
    assert summarize([])["p99"] is None


def rec(i, ttft, gaps, tokens_per_chunk=None, error=None, cached=0, prompt=100, sent=0.0):
    r = RequestRecord(str(i), "t", None, "w", "sse", intended=sent, sent=sent)
    t = sent + ttft
    counts = tokens_per_chunk or [1] * (len(gaps) + 1)
    r.chunks = [(t, counts[0])]
    for g, n in zip(gaps, counts[1:]):
        t += g
        r.chunks.append((t, n))
    r.end = t
    r.error = error
    n = sum(counts)
    r.usage = {"prompt_tokens": prompt, "completion_tokens": n,
               "prompt_tokens_details": {"cached_tokens": cached}}
    return r


def test_itl_is_per_token_and_sums_to_decode_time():
    r = rec(0, 0.1, [0.02, 0.06], tokens_per_chunk=[1, 1, 3])
    assert r.itls() == pytest.approx([0.02, 0.02, 0.02, 0.02])
    assert r.tpot == pytest.approx(0.08 / 4) and r.ttft == pytest.approx(0.1)
    r = rec(1, 0.1, [0.05], tokens_per_chunk=[3, 1])
    assert r.itls() == pytest.approx([0.0, 0.0, 0.05])
    assert rec(2, 0.1, []).tpot == 0.0 and rec(2, 0.1, []).itls() == []


def test_spread_usage_gives_every_message_at_least_one_by_length():
    r = rec(0, 0.1, [0.01, 0.01])
    r.usage["completion_tokens"] = 7
    spread_usage(r, [1, 4, 1])
    assert [n for _, n in r.chunks] == [1, 5, 1]
    r.usage["completion_tokens"] = 2  # fewer than messages: left alone (a mismatch)
    spread_usage(r, [1, 1, 1])
    assert [n for _, n in r.chunks] == [1, 5, 1] and r.usage_mismatch


def test_goodput_and_slo_attainment():
    recs = [rec(0, 0.1, [0.01] * 9), rec(1, 0.3, [0.01] * 9), rec(2, 0.1, [0.05] * 9),
            rec(3, 0.1, [0.01] * 9, error="http_500")]
    for i, r in enumerate(recs):  # one second apart: duration is exactly 3 + 0.19 s
        r.sent = r.intended = float(i)
        r.chunks = [(t + i, n) for t, n in r.chunks]
        r.end += i
    slo = SLO.parse("ttft:200,tpot:20")
    assert [slo.met_by(r) for r in recs] == [True, False, False, False]
    f = figures(recs, slo, PriceBook.preset("seed"))
    d = recs[3].end - 0.0
    assert f["duration_s"] == pytest.approx(d)
    assert f["requests"]["good"] == 1 and f["requests"]["errors"] == {"http_500": 1}
    assert f["throughput"]["goodput_requests_per_s"] == pytest.approx(1 / d)
    assert f["throughput"]["requests_per_s"] == pytest.approx(3 / d)
    assert f["throughput"]["slo_attainment"] == pytest.approx(0.25)
    assert f["throughput"]["output_tokens_per_s"] == pytest.approx(30 / d)
    assert f["latency_ms"]["itl"]["count"] == 27
    assert SLO.parse("itl:30").met_by(recs[2]) is False and SLO().met_by(recs[1])
    with pytest.raises(ValueError):
        SLO.parse("latency:5")


def test_cache_hit_rate_and_money_from_price_book():
    recs = [rec(0, 0.1, [0.01] * 9, cached=0), rec(1, 0.1, [0.01] * 9, cached=80)]
    recs[1].sent, recs[1].end = 0.0, 3600.0  # one hour
    f = figures(recs, SLO(), PriceBook.preset("deepseek-v3"), gpus=2, gpu_cost_per_hour=2.0)
    assert f["cache"]["hit_rate"] == pytest.approx(80 / 200)
    total = (80 * 0.07 + 120 * 0.27 + 20 * 1.10) / 1e6
    m = f["money"]
    assert m["revenue"]["total"] == pytest.approx(total)
    assert m["revenue_per_hour"] == pytest.approx(total)
    assert m["revenue_per_gpu_hour"] == pytest.approx(total / 2)
    assert m["gpu_cost_per_hour"] == 4.0 and m["sources"] == {"price_book": 2}


def test_reported_cost_wins_over_price_book():
    usage = {"prompt_tokens": 10, "completion_tokens": 5,
             "cost": {"cache_hit_input": 0.1, "cache_miss_input": 0.2, "output": 0.3,
                      "total": 0.6}}
    cost, source = request_cost(usage, PriceBook.preset("seed"))
    assert source == "reported" and cost["total"] == 0.6
    cost, source = request_cost({"prompt_tokens": 10, "completion_tokens": 5},
                                PriceBook.preset("seed"))
    assert source == "price_book" and cost["total"] == pytest.approx((1.5 + 3.0) / 1e6)


def test_presets_match_design_table():
    assert [PriceBook.preset(n).output_per_m for n in ("seed", "deepseek-v3", "deepseek-r1")] \
        == [0.60, 1.10, 2.19]
    usage = {"prompt_tokens": 10, "completion_tokens": 0, "cost": {"total": 9.0}}
    book = PriceBook.preset("seed", use_reported=False)
    assert request_cost(usage, book, book.use_reported) == (book.cost(0, 10, 0), "price_book")


def test_sweep_doubles_then_bisects_to_the_highest_passing_rate():
    import asyncio

    from loadtest.sweep import find_max_rate

    async def trial(rate):  # a server whose attainment falls off above 37 req/s
        ok = 1.0 if rate <= 37 else 0.5
        return {"summary": {"throughput": {"slo_attainment": ok, "goodput_requests_per_s": rate},
                            "latency_ms": {"ttft": {"p99": 1.0}, "itl": {"p99": 1.0}}}}
    sweep = asyncio.run(find_max_rate(trial, 5.0, 0.99, steps=4))
    assert [t["rate"] for t in sweep["trials"]] == [5, 10, 20, 40, 30, 35, 37.5, 36.25]
    assert sweep["best_rate"] == 36.25
