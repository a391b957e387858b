"""`--sweep`: the highest open-loop rate whose SLO attainment reaches a target.

Starting at --rate, the rate doubles while runs pass; then the gap between the best passing and
the lowest failing rate is bisected `steps` times. A run passes when the share of its measured
requests that succeed within every SLO limit is at least `target`. Every trial is a full run
(same seed, same duration) and is kept in the result's "sweep" list.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable


async def find_max_rate(trial: Callable[[float], Awaitable[dict]], start: float, target: float,
                        steps: int = 4, max_doublings: int = 8) -> dict:
    """trial(rate) -> result document. Returns {"best_rate", "target", "trials": [...]}."""
    trials: list[dict] = []

    async def passes(rate: float) -> bool:
        s = (await trial(rate))["summary"]
        attained = s["throughput"]["slo_attainment"] or 0.0
        trials.append({"rate": rate, "slo_attainment": attained, "pass": attained >= target,
                       "goodput_requests_per_s": s["throughput"]["goodput_requests_per_s"],
                       "ttft_p99_ms": s["latency_ms"]["ttft"]["p99"],
                       "itl_p99_ms": s["latency_ms"]["itl"]["p99"]})
        return attained >= target

    good, bad, rate = None, None, start
    for _ in range(max_doublings):
        if await passes(rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    if good is None and bad is not None:  # even the start fails: search below it
        good_floor = 0.0
        lo, hi = good_floor, bad
    else:
        lo, hi = good, bad
    if hi is not None:
        for _ in range(steps):
            mid = (lo + hi) / 2
            if mid <= 0:
                break
            if await passes(mid):
                lo = good = mid
            else:
                hi = mid
    return {"best_rate": good, "target": target, "trials": trials}
