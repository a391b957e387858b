"""Console test helpers: the recorded feed, a fixed clock, and waiting for the feed to settle."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from console.app import ConsoleApp
from console.feed import ReplayFeed

FEED = Path(__file__).parent / "data" / "feed.jsonl"
FIXED_NOW = 1_800_000_000.0


def fixed_clock() -> float:
    return FIXED_NOW


def replay_app(path: Path = FEED, fleet_gpus: int = 128) -> ConsoleApp:
    """The console on a recording played as fast as possible, with the clock fixed."""
    return ConsoleApp(ReplayFeed(path, speed=0), fleet_gpus=fleet_gpus, now=fixed_clock)


async def wait_until(pilot, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Let the app run until predicate() holds; fail after timeout seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting; state: {pilot.app.state.connection}")
        await pilot.pause(0.02)
    await pilot.pause()


async def replay_finished(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.state.connection.startswith("ended"))
