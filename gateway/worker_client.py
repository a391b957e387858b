"""The gateway's side of one runtime worker process: spawn, talk frames, notice death, restart.

Each in-flight request owns an asyncio.Queue that receives its output dicts (see
runtime/protocol.py), a `{"type": "rejected"}` dict, or a WorkerDied exception. A worker whose
pipe closes is dead at once: every in-flight request gets WorkerDied, and a supervisor starts a
fresh process with backoff while the gateway keeps serving from the others.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from runtime.protocol import encode_frame, read_frame

log = logging.getLogger(__name__)


class WorkerDied(Exception):
    """The worker process ended while the request was in flight."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class WorkerHandle:
    def __init__(self, index: int, argv: list[str], env: dict | None = None,
                 ready_timeout: float = 300.0):
        self.index = index
        self.argv = argv
        self.env = env
        self.ready_timeout = ready_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict = {}
        self.stats: dict = {}
        self.inflight: dict[str, asyncio.Queue] = {}
        self.priorities: dict[str, int] = {}
        self.pending_blocks = 0  # prompt blocks dispatched but not yet seen in stats
        self.ready = asyncio.Event()
        self.restarts = 0
        self.started_at = 0.0
        self._reader: asyncio.Task | None = None
        self._closing = False
        self.on_ready = None  # callback(handle) when a (re)started worker is ready
        self.on_output = None  # callback(handle, output dict) for metering and telemetry

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self.ready.clear()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.worker", *self.argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **(self.env or {})}, limit=64 << 20)
        try:
            message = await asyncio.wait_for(read_frame(self.proc.stdout), self.ready_timeout)
        except BaseException:
            self.proc.kill()
            await self.proc.wait()
            raise
        if message is None or message.get("type") != "ready":
            await self.proc.wait()
            raise RuntimeError(f"worker {self.index} did not start (exit {self.proc.returncode})")
        self.info = message
        self.started_at = time.monotonic()
        self._reader = asyncio.create_task(self._read_loop(), name=f"worker-{self.index}-reader")
        self.ready.set()
        if self.on_ready is not None:
            self.on_ready(self)

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self._send({"type": "shutdown"})
            await asyncio.wait_for(self.proc.wait(), timeout)
        except (asyncio.TimeoutError, ConnectionError):
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], params: dict, priority: int,
               salt: str | None, stream: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send a request; its outputs arrive on `stream` (several requests may share one)."""
        if not self.alive:
            raise WorkerDied(f"worker {self.index} is not running")
        stream = stream if stream is not None else asyncio.Queue()
        self.inflight[request_id] = stream
        self.priorities[request_id] = priority
        self.pending_blocks += self.blocks_for(len(prompt))
        self._send({"type": "add", "id": request_id, "prompt": prompt, "params": params,
                    "priority": priority, "salt": salt})
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the worker to drop a request; its final output still arrives (and is billed)."""
        if request_id in self.inflight and self.alive:
            self._send({"type": "abort", "id": request_id})

    def release(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)
        self.priorities.pop(request_id, None)

    # ---- load ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        bs = self.info.get("block_size", 16)
        return -(-num_tokens // bs)

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def free_slots(self) -> int:
        return self.info.get("max_num_seqs", 0) - len(self.inflight)

    @property
    def free_blocks(self) -> int:
        total = self.stats.get("kv_blocks_total", self.info.get("num_blocks", 0))
        return total - self.stats.get("kv_blocks_used", 0) - self.pending_blocks

    @property
    def load(self) -> float:
        """Fraction of the worker's request slots in use (0 idle, 1 full)."""
        return len(self.inflight) / max(1, self.info.get("max_num_seqs", 1))

    def least_urgent_priority(self) -> int | None:
        return max(self.priorities.values(), default=None)

    # ---- frames -------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        self.proc.stdin.write(encode_frame(message))

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await read_frame(self.proc.stdout)
                if message is None:
                    break
                self._handle(message)
        except Exception:  # noqa: BLE001 - a garbled pipe is as good as a dead worker
            log.exception("worker %d sent a bad frame", self.index)
            self.proc.kill()
        await self.proc.wait()
        self._on_death()

    def _handle(self, message: dict) -> None:
        kind = message["type"]
        if kind == "step":
            if message.get("stats"):
                self.stats = message["stats"]
                self.pending_blocks = 0
            for out in message["outputs"]:
                if self.on_output is not None:
                    self.on_output(self, out)
                stream = self.inflight.get(out["id"])
                if stream is not None:
                    stream.put_nowait(out)
                if out["finished"]:
                    self.release(out["id"])
        elif kind == "stats":
            self.stats = message["stats"]
            self.pending_blocks = 0
        elif kind == "rejected":
            stream = self.inflight.get(message["id"])
            if self.on_output is not None:
                self.on_output(self, _ended(message["id"], "rejected"))
            self.release(message["id"])
            if stream is not None:
                stream.put_nowait(message)

    def _on_death(self) -> None:
        self.ready.clear()
        code = self.proc.returncode
        if not self._closing:
            log.error("worker %d (pid %s) exited with %s; %d requests failed",
                      self.index, self.pid, code, len(self.inflight))
        for rid, stream in list(self.inflight.items()):
            if self.on_output is not None:
                self.on_output(self, _ended(rid, "error"))
            stream.put_nowait(WorkerDied(f"worker {self.index} exited with code {code}", rid))
        self.inflight.clear()
        self.priorities.clear()
        self.pending_blocks = 0


def _ended(request_id: str, reason: str) -> dict:
    """A final output for a request that produced nothing we can bill (refused, or lost)."""
    return {"id": request_id, "tokens": [], "text": "", "finished": True, "reason": reason,
            "stop_reason": None, "usage": None, "logprobs": None, "synthetic": True}


async def supervise(handle: WorkerHandle, stop: asyncio.Event, max_backoff: float = 10.0):
    """Keep a started worker running: after a death, start a fresh one with backoff."""
    backoff = 0.5
    while not stop.is_set():
        dead = handle.proc is not None and handle.proc.returncode is not None \
            and not handle.ready.is_set() and not handle._closing
        if not dead:
            await asyncio.sleep(0.05)
            continue
        try:
            await handle.start()
            handle.restarts += 1
            backoff = 0.5
        except Exception as exc:  # noqa: BLE001 - keep trying; the gateway stays up
            log.error("worker %d failed to start: %s; retrying in %.1fs", handle.index, exc,
                      backoff)
            await asyncio.sleep(backoff)
            backoff = min(max_backoff, backoff * 2)
