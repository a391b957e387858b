"""Elastic capacity: workers join and leave the dispatcher's pool while the gateway serves.

`add_remote(url)` connects a shared worker (runtime/transport/serve.py) and `spawn()` starts a local
worker process like the configured ones; either is placed in the dispatcher's list at once
(the dispatcher skips it until it is ready). `drain(index)` takes one out without losing
anything: the dispatcher sends it nothing new (queued requests wait for the others), the
requests running on it finish and are billed as usual, then it is closed and removed from the
dispatcher, the prefix index and the metrics. A drain that outlasts its timeout aborts what
is still running there: each aborted request ends with finish reason "abort" and is billed
for the tokens it produced, as a client that left would be.

Indices are never reused, so a newcomer never inherits a departed worker's prefix-cache
entries or metric series. The pool's size is reported to the dispatcher's worker clock on
every change (worker-seconds, the divisor of revenue per GPU-hour).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from contract.frames import TOKEN_ENV
from gateway.workers.handle import WorkerHandle, supervise
from gateway.workers.remote_handle import RemoteWorkerHandle, parse_worker_url

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.serving.dispatch import Dispatcher
    from gateway.telemetry.metrics import GatewayMetrics


class PoolView(Protocol):
    """What the pool reads and changes of the gateway (its state): the very worker list the
    dispatcher places jobs from, the dispatcher, the settings, the metrics, the stop event."""

    workers: list[WorkerHandle]
    dispatcher: Dispatcher
    config: GatewayConfig
    metrics: GatewayMetrics | None
    stop: asyncio.Event

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_SECONDS = 300.0  # then what still runs is aborted and billed as produced
ABORT_GRACE_SECONDS = 10.0  # for aborted requests' final (billed) outputs to come back


class PoolError(Exception):
    """A pool change that cannot be made; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class WorkerPool:
    def __init__(self, state: PoolView, drain_timeout: float = DRAIN_TIMEOUT_SECONDS):
        self.state = state
        self.drain_timeout = drain_timeout
        self.next_index = max((w.index for w in state.workers), default=-1) + 1
        self.drains: dict[int, asyncio.Task] = {}
        self.supervisors: dict[int, asyncio.Task] = {}
        self.removed = 0  # workers drained and gone, for tests and the log

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.state.workers  # the very list the dispatcher places jobs from

    def _check_elastic(self) -> None:
        if self.state.dispatcher.disaggregated:
            raise PoolError(409, "workers cannot be added or removed with --pd")

    # ---- joining ------------------------------------------------------------------------
    async def add_remote(self, url: str) -> WorkerHandle:
        """Connect a shared worker at tcp://HOST:PORT; returns once it is ready (a worker that
        cannot be reached is left out again: 502)."""
        self._check_elastic()
        try:
            parse_worker_url(url)
        except ValueError as exc:
            raise PoolError(400, str(exc), "url") from None
        if any(getattr(w, "url", None) == url for w in self.workers):
            raise PoolError(409, f"{url} is already in the pool", "url")
        config = self.state.config
        token = os.environ.get(TOKEN_ENV) or None  # the secret the configured ones use
        handle = RemoteWorkerHandle(self._take_index(), url, token,
                                    config.worker_ready_timeout, self._events())
        return await self._join(handle, first_try_only=True)

    async def spawn(self) -> WorkerHandle:
        """Start one more local worker process with the configured worker flags."""
        self._check_elastic()
        config = self.state.config
        if config.ray_address:
            raise PoolError(409, "spawning is not supported with --ray-address")
        handle = WorkerHandle(self._take_index(), config.worker_argv(),
                              ready_timeout=config.worker_ready_timeout, events=self._events())
        worker = await self._join(handle)
        self.supervisors[worker.index] = asyncio.create_task(
            supervise(worker, self.state.stop), name=f"worker-{worker.index}-supervisor")
        return worker

    def _take_index(self) -> int:
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    def _events(self):
        # every handle reports to the gateway's one listener; the configured ones carry it
        return self.workers[0].events if self.workers else None

    async def _join(self, handle: WorkerHandle, first_try_only: bool = False) -> WorkerHandle:
        self.workers.append(handle)
        self._resized()
        try:
            if first_try_only:  # a remote handle retries forever: the caller wants an answer
                await asyncio.wait_for(handle.start(), self.state.config.worker_ready_timeout)
            else:
                await handle.start()
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the pool unchanged
            await self._forget(handle)
            raise PoolError(502, f"worker {handle.index} did not start: {exc}") from None
        log.info("worker %d joined the pool (%s)", handle.index, describe(handle)["kind"])
        self.state.dispatcher.notify()
        return handle

    # ---- leaving ------------------------------------------------------------------------
    def drain(self, index: int) -> asyncio.Task:
        """Begin draining worker `index` (404 unknown, 409 the last one); returns the task
        that finishes when it is gone."""
        self._check_elastic()
        worker = self.get(index)
        if index in self.drains:
            return self.drains[index]
        serving = [w for w in self.workers if w.index not in self.state.dispatcher.draining]
        if len(serving) <= 1:
            raise PoolError(409, "the last worker cannot be removed")
        self.state.dispatcher.draining.add(index)
        task = asyncio.create_task(self._drain(worker), name=f"worker-{index}-drain")
        self.drains[index] = task
        return task

    async def _drain(self, worker: WorkerHandle) -> None:
        try:
            if not await self._until_idle(worker, self.drain_timeout):
                log.warning("worker %d: drain timed out; aborting %d requests", worker.index,
                            worker.num_inflight)
                for request_id in list(worker.inflight):
                    worker.abort(request_id)
                await self._until_idle(worker, ABORT_GRACE_SECONDS)
            await worker.close()
        finally:
            await self._forget(worker)
            self.drains.pop(worker.index, None)
            self.removed += 1
            log.info("worker %d left the pool", worker.index)

    async def _until_idle(self, worker: WorkerHandle, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while worker.num_inflight and worker.alive:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _forget(self, worker: WorkerHandle) -> None:
        supervisor = self.supervisors.pop(worker.index, None)
        if supervisor is not None:
            supervisor.cancel()
        await worker.close()  # again after a drain's close: a no-op then
        if worker in self.workers:
            self.workers.remove(worker)
            self._resized()
        dispatcher = self.state.dispatcher
        dispatcher.draining.discard(worker.index)
        dispatcher.prefix_index.retain({w.index: w.pid for w in self.workers if w.alive})
        if self.state.metrics is not None:
            self.state.metrics.forget_worker(worker.index)
        dispatcher.notify()

    def _resized(self) -> None:
        self.state.dispatcher.worker_time.resize(len(self.workers))

    async def close(self) -> None:
        """Shutdown: stop drains and supervisors (the app closes every worker itself)."""
        tasks = list(self.drains.values()) + list(self.supervisors.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- reading ------------------------------------------------------------------------
    def get(self, index: int) -> WorkerHandle:
        for w in self.workers:
            if w.index == index:
                return w
        raise PoolError(404, f"no worker {index}", "index")

    def describe_all(self) -> list[dict]:
        draining = self.state.dispatcher.draining
        return [describe(w, w.index in draining) for w in self.workers]


def describe(worker: WorkerHandle, draining: bool = False) -> dict:
    """One worker as the admin routes and the fleet registry show it."""
    url = getattr(worker, "url", None)
    return {"index": worker.index, "kind": "remote" if url else "local", "url": url,
            "pid": worker.pid, "alive": worker.alive, "draining": draining,
            "running": worker.num_inflight, "load": round(worker.load, 4),
            "max_num_seqs": worker.max_num_seqs, "restarts": worker.restarts}
