"""Recent amounts for the live snapshot: cache hits and misses and dollars over the last
minute or hour, and the latencies of the last five minutes (the snapshot takes their
percentiles with `numeric.percentiles`).

Memory and the cost of a snapshot stay bounded whatever the request rate: amounts are summed
into one-second buckets (at most an hour of them), and latencies keep only the newest
`MAX_LATENCY_SAMPLES` requests of the window. (Keeping every request of the last hour, as
this once did, held about 250 bytes per request: 0.8 MiB a minute at 55 requests a second,
and a second's snapshot walked all of them; the 30-minute soak caught it.)
"""
from __future__ import annotations

import time
from collections import deque

WINDOW_SECONDS = 3600
LATENCY_WINDOW_SECONDS = 300
MAX_LATENCY_SAMPLES = 20_000


class RollingTotals:
    def __init__(self, clock=time.time):
        self.clock = clock
        self.buckets: deque[list] = deque()  # [second, hit tokens, miss tokens, dollars]
        self.latencies: deque[tuple] = deque(maxlen=MAX_LATENCY_SAMPLES)  # (time, ttft, itl)

    def add(self, hit: int, miss: int, dollars: float, ttft: float | None,
            itl: float | None) -> None:
        now = self.clock()
        second = int(now)
        if self.buckets and self.buckets[-1][0] == second:
            bucket = self.buckets[-1]
            bucket[1] += hit
            bucket[2] += miss
            bucket[3] += dollars
        else:
            self.buckets.append([second, hit, miss, dollars])
            while second - self.buckets[0][0] >= WINDOW_SECONDS:
                self.buckets.popleft()
        if ttft is not None or itl is not None:
            self.latencies.append((now, ttft, itl))

    def sums(self, seconds: float) -> tuple[int, int, float]:
        """(hit tokens, miss tokens, dollars) of the requests settled in the last `seconds`
        (to the second)."""
        cutoff = int(self.clock() - seconds)
        hit = miss = 0
        dollars = 0.0
        for second, h, m, d in reversed(self.buckets):
            if second < cutoff:
                break
            hit, miss, dollars = hit + h, miss + m, dollars + d
        return hit, miss, dollars

    def recent_latencies(self) -> tuple[list[float], list[float]]:
        """(TTFTs, inter-token latencies) of the newest requests of the last five minutes."""
        cutoff = self.clock() - LATENCY_WINDOW_SECONDS
        ttft, itl = [], []
        for when, t, i in reversed(self.latencies):
            if when < cutoff:
                break
            if t is not None:
                ttft.append(t)
            if i is not None:
                itl.append(i)
        return ttft, itl
