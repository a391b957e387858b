"""How long the event loop was held: a task that asks to wake every `INTERVAL_S` measures how
late it woke. Everything the gateway does for every client runs on this one loop, so a body
that holds it for a second delays every stream's next token by that second; the lag is the
symptom a hostile request shows whatever its cause.

Exported as a histogram of the lags seen and a counter of stalls, which the reliability suite
reads before and after each case. A stall is a wake later than `STALL_S` during which the
loop's own thread ran for longer than `STALL_S`: our code held the loop. A late wake with the
thread idle is the machine's scheduler giving the core to another process, which no change of
ours could fix, so the histogram shows it but the stall count does not."""
from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

INTERVAL_S = 0.02
STALL_S = 0.1  # a client sees this as a hitch in its stream
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    def __init__(self) -> None:
        self.worst = 0.0  # the longest lag seen since start, in seconds
        self.lags = Histogram("inferstack:event_loop_lag_seconds",
                              "How late the gateway's event loop woke a timer, sampled every "
                              f"{INTERVAL_S * 1000:.0f} ms", buckets=BUCKETS, registry=None)
        self.stalls = Counter("inferstack:event_loop_stalls",
                              f"Times the event loop was held over {STALL_S * 1000:.0f} ms",
                              registry=None)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.lags)
        registry.register(self.stalls)

    def record(self, lag: float, busy: float) -> None:
        """`lag`: how late the wake was; `busy`: the loop thread's CPU time meanwhile."""
        self.lags.observe(lag)
        self.worst = max(self.worst, lag)
        if lag > STALL_S and busy > STALL_S:
            self.stalls.inc()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            start, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(INTERVAL_S)
            lag = max(0.0, time.perf_counter() - start - INTERVAL_S)
            self.record(lag, time.thread_time() - cpu)
