"""Driving the load: open loop (a fixed schedule of send times) or closed loop (C users each
sending its next request when the last one ends), with an optional cap on requests in flight.

Each record gets `intended` (the schedule's time; for a closed loop, when its user became free)
and `sent`. With a cap, a request waits for a free slot after `intended`, so the wait shows as
schedule lag rather than vanishing (no coordinated omission). Sending stops at --duration or
after --requests; requests still running get `grace` seconds, then count as "incomplete".
Warm-up and cool-down: only requests intended within [warmup, send_end - cooldown] are
measured, where send_end is the duration (or the last intended time with --requests).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loadtest.arrivals import arrival_times
from loadtest.client import Client
from loadtest.day_profile import DayProfile
from loadtest.looplag import LoopLag
from loadtest.record import RequestRecord
from loadtest.workloads import RequestSpec


@dataclass(frozen=True)
class LoadShape:
    rate: float | None = None  # open loop when set
    arrival: str = "poisson"
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop users when set
    max_concurrency: int | None = None  # cap on requests in flight, either loop
    duration: float | None = None
    requests: int | None = None
    warmup: float = 0.0
    warmup_requests: int = 0  # the first K requests are excluded too
    cooldown: float = 0.0
    grace: float = 60.0
    time_scale: float = 1.0  # trace timestamps are multiplied by this
    day: DayProfile | None = None  # open loop at a rate that follows a day's curve

    def as_dict(self) -> dict:
        day = None if self.day is None else dict(
            self.day.__dict__, points=[list(p) for p in self.day.points])
        return dict(self.__dict__, day=day, mode="open" if self.rate or not self.concurrency
                    else "closed")


@dataclass
class RunOutput:
    records: list[RequestRecord]
    send_end: float
    wall: float
    loop_lag: list[float]  # seconds late per wake-up, within the measured window
    loop_lag_all: list[float]  # the same over the whole run
    max_in_flight: int


class Runner:
    def __init__(self, client: Client, specs: Iterator[RequestSpec], shape: LoadShape,
                 seed: int = 0, workload: str = ""):
        self.client, self.specs, self.shape = client, specs, shape
        self.seed, self.workload = seed, workload
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lag = LoopLag(self.now)
        self.cap = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
        self.tasks: set[asyncio.Task] = set()
        self.started = False

    def now(self) -> float:
        return self.client.now()

    def _more(self, count: int, t: float) -> bool:
        s = self.shape
        if s.requests is not None and count >= s.requests:
            return False
        return s.duration is None or t < s.duration

    async def run(self, on_start: Callable[[], None] | None = None) -> RunOutput:
        self.client.origin = time.perf_counter()
        self.lag.start()
        self.started = True
        if on_start:
            on_start()
        if self.shape.concurrency and not self.shape.rate:
            await self._closed()
        else:
            await self._open()
        await asyncio.sleep(0)  # let the last tasks record themselves
        await self._drain()
        send_end = self.shape.duration if self.shape.duration else max(
            (r.intended for r in self.records), default=0.0)
        await self.lag.stop()
        lo, hi = self._mark_window(send_end)
        return RunOutput(self.records, send_end, self.now(), self.lag.within(lo, hi),
                         [late for _, late in self.lag.samples], self.max_in_flight)

    async def _open(self) -> None:
        times = self.shape.day.arrival_times(self.seed) if self.shape.day else \
            arrival_times(self.shape.arrival, self.shape.rate or 1.0, self.seed,
                          self.shape.burstiness)
        for count, spec in enumerate(self.specs):
            t = next(times) if spec.arrival is None or self.shape.rate else \
                spec.arrival * self.shape.time_scale
            if not self._more(count, t):
                break
            delay = t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(spec, t))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _closed(self) -> None:
        counter = iter(range(1 << 62))

        async def user() -> None:
            while True:
                t = self.now()
                if not self._more(next(counter), t):
                    return
                spec = next(self.specs, None)
                if spec is None:
                    return
                await self._one(spec, t)
        users = [asyncio.create_task(user()) for _ in range(self.shape.concurrency)]
        self.tasks.update(users)
        await asyncio.gather(*users, return_exceptions=True)
        self.tasks.difference_update(users)

    async def _one(self, spec: RequestSpec, intended: float) -> None:
        rec = RequestRecord(f"{spec.index}", spec.tenant, spec.priority, self.workload,
                            self.client.protocol, intended)
        self.records.append(rec)
        if self.cap is not None:
            await self.cap.acquire()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.client.send(spec, rec)
        except asyncio.CancelledError:
            rec.error = rec.error or "incomplete"
            rec.error_message = "still running when the run ended"
            rec.end = rec.end or self.now()
            raise
        finally:
            self.in_flight -= 1
            if self.cap is not None:
                self.cap.release()

    async def _drain(self) -> None:
        if not self.tasks:
            return
        _, pending = await asyncio.wait(set(self.tasks), timeout=self.shape.grace)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _mark_window(self, send_end: float) -> tuple[float, float]:
        lo, hi = self.shape.warmup, send_end - self.shape.cooldown
        for r in self.records:
            r.warmup = not (lo <= r.intended <= hi)
        for r in sorted(self.records, key=lambda r: r.intended)[:self.shape.warmup_requests]:
            r.warmup = True
        return lo, hi
