"""The load tester's own health: how late its event loop wakes up.

A task asks to sleep `interval` seconds over and over; each wake-up later than asked is lag
(time the loop spent on other callbacks). Lag in the tens of milliseconds means the client,
not the server, is shaping the measurements.
"""
from __future__ import annotations

import asyncio
import time


class LoopLag:
    def __init__(self, now, interval: float = 0.005):
        self.now, self.interval = now, interval
        self.samples: list[tuple[float, float]] = []  # (time, seconds late) per wake-up
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _watch(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            late = max(0.0, time.perf_counter() - asked - self.interval)
            self.samples.append((self.now(), late))

    def within(self, lo: float, hi: float) -> list[float]:
        return [late for t, late in self.samples if lo <= t <= hi]
