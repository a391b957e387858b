"""Distribution summaries: plain arithmetic, with the documented interpolation.

Percentiles are `numeric.percentiles.percentile`, the one the gateway's live feed uses too:
linear interpolation between closest ranks (numpy's default "linear" method): for sorted values
v[0..n-1] and percentile p, the rank is r = p/100 * (n - 1) and the result is
v[floor(r)] + (v[ceil(r)] - v[floor(r)]) * (r - floor(r)).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from numeric.percentiles import percentile

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def pkey(p: float) -> str:
    """The key of percentile p in result dictionaries: 50 -> "p50", 99.9 -> "p99.9"."""
    return "p" + (str(int(p)) if float(p).is_integer() else str(p))


def summarize(values: Sequence[float], scale: float = 1.0) -> dict:
    """count, mean, std, min, max and PERCENTILES of values, each multiplied by scale.

    An empty input gives count 0 and None elsewhere (JSON has no NaN)."""
    xs = sorted(v * scale for v in values)
    n = len(xs)
    if n == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                **{pkey(p): None for p in PERCENTILES}}
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / n
    return {"count": n, "mean": mean, "std": math.sqrt(var), "min": xs[0], "max": xs[-1],
            **{pkey(p): percentile(xs, p) for p in PERCENTILES}}
