"""The event-loop lag monitor: a callback that holds the loop counts as a stall; a late wake
while the loop's thread sat idle (the scheduler ran another process) does not."""
from __future__ import annotations

import asyncio
import time

from gateway.telemetry.loop_lag import STALL_S, LoopLag


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _watch(hold) -> LoopLag:
    lag, stop = LoopLag(), asyncio.Event()
    task = asyncio.create_task(lag.run(stop))
    await asyncio.sleep(0.05)
    hold()
    await asyncio.sleep(0.05)
    stop.set()
    await task
    return lag


def _stalls(lag: LoopLag) -> float:
    return lag.stalls._value.get()


def test_a_callback_holding_the_loop_is_a_stall():
    lag = asyncio.run(_watch(lambda: _spin(STALL_S * 2)))
    assert _stalls(lag) == 1 and lag.worst >= STALL_S * 1.5


def test_an_idle_late_wake_is_lag_but_not_a_stall():
    lag = asyncio.run(_watch(lambda: time.sleep(STALL_S * 2)))  # the thread sleeps, no CPU
    assert _stalls(lag) == 0 and lag.worst >= STALL_S * 1.5


def test_short_work_is_neither():
    lag = LoopLag()
    lag.record(0.01, 0.01)
    lag.record(STALL_S * 3, 0.0)
    assert _stalls(lag) == 0
    lag.record(STALL_S * 3, STALL_S * 3)
    assert _stalls(lag) == 1
