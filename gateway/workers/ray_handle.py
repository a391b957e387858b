"""Cluster mode: a runtime worker as a Ray actor (runtime/transport/ray_worker.py), placed by Ray
on any node, with the same frames and the same supervision as a worker process."""
from __future__ import annotations

import asyncio
import logging

from contract.frames import Frame, encode_frame
from gateway.workers.handle import WorkerEvents, WorkerHandle

log = logging.getLogger(__name__)


class _ActorProcess:
    """Stands in for a worker's process handle (returncode, kill, wait) for a Ray actor."""

    def __init__(self, actor, pid: int | None):
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def kill(self) -> None:
        import ray
        ray.kill(self.actor, no_restart=True)
        self.ended(-9)

    async def wait(self) -> int:
        await self._ended.wait()
        return self.returncode


class RayWorkerHandle(WorkerHandle):
    """A worker placed by Ray as an actor (runtime/transport/ray_worker.py) on any node of the
    cluster, with the same frames as a process; a failed actor is replaced by a fresh one through
    Ray (the supervisor calls `start` again)."""

    def __init__(self, index: int, argv: list[str], ready_timeout: float = 300.0,
                 num_cpus: float = 1, num_gpus: float = 0, events: WorkerEvents | None = None):
        super().__init__(index, argv, ready_timeout=ready_timeout, events=events)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus

    async def start(self) -> None:
        import ray

        from runtime.transport.ray_worker import RayWorker
        self.ready.clear()
        groups = {"push": 1, "pull": 1}  # one thread each: frames keep their order
        actor_class = ray.remote(concurrency_groups=groups)(RayWorker)  # type: ignore[call-overload]
        actor = actor_class.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                    max_restarts=0).remote(self.argv)
        self.actor_proc = _ActorProcess(actor, None)
        # it stands in for the process: the base class only reads returncode, pid, kill, wait
        self.proc = self.actor_proc  # type: ignore[assignment]
        try:
            message = await asyncio.wait_for(actor.ready.remote(), self.ready_timeout)
        except BaseException:
            self.proc.kill()
            raise
        self.proc.pid = message.pid
        self._mark_ready(message, self._pull_loop(), "pull")

    def _encode(self, message: Frame):
        encode_frame(message)  # Ray carries the frame itself; refuse what a pipe would refuse
        return message

    def _write(self, payload) -> None:
        self.actor_proc.actor.push.remote(payload)

    async def _pull_loop(self) -> None:
        import ray
        actor = self.actor_proc.actor
        try:
            while True:
                for message in await actor.pull.remote(0.5):
                    self._handle(message)
        except ray.exceptions.RayError as exc:
            if not self._closing:
                log.error("worker %d (Ray actor) failed: %s", self.index, exc)
        except Exception:  # noqa: BLE001 - a bad frame is as good as a dead worker
            log.exception("worker %d sent a bad frame", self.index)
            self.proc.kill()
        self.actor_proc.ended(self.proc.returncode if self.proc.returncode is not None else 1)
        self._on_death()
