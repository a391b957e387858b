"""The one percentile: linear interpolation between closest ranks (numpy's default "linear").

For values sorted as v[0..n-1] and a percentile p in 0..100, the rank is r = p/100 * (n - 1)
and the result is v[floor(r)] + (v[ceil(r)] - v[floor(r)]) * (r - floor(r)). The gateway's live
feed (so the console), the load tester and the benchmarks all take their percentiles here, so
the same latencies give the same p99 everywhere.
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100) of values in any order; NaN when there are none.

    Callers that need another empty answer (None for JSON) choose it at their boundary.
    Raises ValueError for p outside 0..100. Already sorted input costs one linear pass."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is outside 0..100")
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan
    rank = p / 100.0 * (n - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)
