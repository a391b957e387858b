"""An optional autoscale policy: grow the pool under a sustained queue, shrink it when idle.

The decision is a pure function of a recorded load history (`decide`), so it is tested
without processes; `autoscale_loop` samples the gateway once a second and applies it through
the worker pool (gateway/serving/worker_pool.py). It grows by spawning a local worker when
the queue stayed deeper than `queue_depth` for all of `grow_seconds` (a blip does not count),
and shrinks by draining the most idle worker when the queue stayed empty and that worker ran
nothing for all of `idle_seconds`; never below `min_workers` nor above `max_workers`, and one
change at a time, each followed by `cooldown_seconds` for its effect to show.

Off unless the config has `autoscale_max` > 0 (read with defaults, so it works before the
settings exist).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    min_workers: int = 1
    max_workers: int = 1
    queue_depth: int = 0  # a queue deeper than this is pressure
    grow_seconds: float = 10.0
    idle_seconds: float = 60.0
    cooldown_seconds: float = 10.0


@dataclass(frozen=True)
class Sample:
    time: float
    queue_depth: int
    running: tuple[tuple[int, int], ...]  # (worker index, requests running) of serving workers


@dataclass(frozen=True)
class Decision:
    action: str  # "grow", "shrink" or "hold"
    worker: int | None = None  # the one to drain, for "shrink"
    reason: str = ""


HOLD = Decision("hold")


def decide(history: Sequence[Sample], policy: Policy,
           last_change: float | None = None) -> Decision:
    """What to do now, the last sample being now. The cooldown first, then the bounds, then
    growth under a queue held for the whole window, then shrinking an idle worker."""
    if not history:
        return HOLD
    now = history[-1]
    size = len(now.running)
    if last_change is not None and now.time - last_change < policy.cooldown_seconds:
        return HOLD
    if size < policy.min_workers:
        return Decision("grow", reason=f"{size} workers, fewer than {policy.min_workers}")
    if size > policy.max_workers:
        return Decision("shrink", _most_idle(history, now.time - policy.idle_seconds),
                        f"{size} workers, more than {policy.max_workers}")
    queued = _window(history, policy.grow_seconds)
    if size < policy.max_workers and queued and all(s.queue_depth > policy.queue_depth
                                                     for s in queued):
        return Decision("grow", reason=f"queue above {policy.queue_depth} for "
                                       f"{policy.grow_seconds:g}s")
    idle = _window(history, policy.idle_seconds)
    if size > policy.min_workers and idle and all(s.queue_depth == 0 for s in idle):
        ran: dict[int, int] = {}
        for s in idle:
            for index, running in s.running:
                ran[index] = ran.get(index, 0) + running
        present = set.intersection(*(set(i for i, _ in s.running) for s in idle))
        candidates = [i for i in present if ran[i] == 0]
        if candidates:
            return Decision("shrink", max(candidates),  # the newest of the idle
                            f"worker idle for {policy.idle_seconds:g}s")
    return HOLD


def _window(history: Sequence[Sample], seconds: float) -> list[Sample]:
    """The samples of the last `seconds`, or [] when the history is shorter than that."""
    now = history[-1].time
    if history[0].time > now - seconds:
        return []
    return [s for s in history if s.time >= now - seconds]


def _most_idle(history: Sequence[Sample], since: float) -> int:
    ran: dict[int, int] = {i: 0 for i, _ in history[-1].running}
    for s in history:
        if s.time >= since:
            for index, running in s.running:
                if index in ran:
                    ran[index] += running
    return min(ran, key=lambda i: (ran[i], -i))


def policy_from_config(config) -> Policy | None:
    most = int(getattr(config, "autoscale_max", 0) or 0)
    if most <= 0:
        return None
    return Policy(min_workers=max(1, int(getattr(config, "autoscale_min", 1) or 1)),
                  max_workers=most,
                  queue_depth=int(getattr(config, "autoscale_queue_depth", 0) or 0),
                  grow_seconds=float(getattr(config, "autoscale_grow_seconds", 10.0)),
                  idle_seconds=float(getattr(config, "autoscale_idle_seconds", 60.0)),
                  cooldown_seconds=float(getattr(config, "autoscale_cooldown_seconds", 10.0)))


def sample(pool, now: float | None = None) -> Sample:
    draining = pool.state.dispatcher.draining
    return Sample(time.monotonic() if now is None else now, len(pool.state.queue),
                  tuple((w.index, w.num_inflight) for w in pool.workers
                        if w.index not in draining))


async def autoscale_loop(pool, policy: Policy, stop: asyncio.Event,
                         interval: float = 1.0) -> None:
    """Sample, decide, apply; a change in progress (a drain, a start) holds the next one."""
    keep = max(policy.grow_seconds, policy.idle_seconds) + 2 * interval
    history: deque[Sample] = deque()
    last_change: float | None = None
    while not stop.is_set():
        await asyncio.sleep(interval)
        s = sample(pool)
        history.append(s)
        while history and history[0].time < s.time - keep:
            history.popleft()
        if pool.drains:
            continue
        decision = decide(history, policy, last_change)
        if decision.action == "hold":
            continue
        log.info("autoscale: %s %s (%s)", decision.action,
                 "" if decision.worker is None else decision.worker, decision.reason)
        try:
            if decision.action == "grow":
                await pool.spawn()
            else:
                pool.drain(decision.worker)
        except Exception as exc:  # noqa: BLE001 - the policy tries again after its cooldown
            log.error("autoscale: %s failed: %s", decision.action, exc)
        last_change = time.monotonic()
        history.clear()  # the next decision looks only at what followed this one
