"""Open-loop arrival times: seconds from the start at which each request should be sent.

poisson   exponential gaps of mean 1/rate
gamma     gamma gaps of mean 1/rate with shape = burstiness (< 1 burstier than Poisson,
          > 1 smoother; 1 is Poisson)
constant  exactly 1/rate apart
The schedule is fixed in advance by the seed: it never waits for responses, so a slow server
(or a slow client) cannot thin the offered load; lateness shows up as schedule lag instead.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

KINDS = ("poisson", "gamma", "constant")


def arrival_times(kind: str, rate: float, seed: int, burstiness: float = 1.0) -> Iterator[float]:
    if rate <= 0:
        raise ValueError("rate must be positive")
    if kind not in KINDS:
        raise ValueError(f"unknown arrival process {kind!r}: {', '.join(KINDS)}")
    rng = random.Random(seed ^ 0x5EED)
    t = 0.0
    while True:
        yield t
        t += gap(kind, rate, rng, burstiness)


def gap(kind: str, rate: float, rng: random.Random, burstiness: float) -> float:
    if kind == "constant":
        return 1.0 / rate
    if kind == "poisson" or burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
