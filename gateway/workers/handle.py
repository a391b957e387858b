"""The gateway's side of one runtime worker process: spawn, talk frames, notice death, restart.

Each in-flight request owns an OutputStream (gateway/workers/output_stream.py) that receives
its `Output` dicts (see contract/frames.py), a `Rejected` frame, or a WorkerDied exception. A
worker whose pipe closes is dead at once: every in-flight request gets WorkerDied, and a
supervisor starts a fresh process with backoff while the gateway keeps serving from the others.

The frames, placements, load and loss handling here are every handle's: a Ray actor
(gateway/workers/ray_handle.py) and a shared worker over TCP (gateway/workers/remote_handle.py)
replace only how the worker starts, how frames travel and how it comes back.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from contract.errors import START_ERROR_EXIT, START_ERROR_PREFIX, StartError
from contract.frames import (
    AbortRequest,
    AddRequest,
    Frame,
    IdleStats,
    ImportFailed,
    KvEvents,
    Output,
    Ready,
    Rejected,
    Shutdown,
    Step,
    TransferDone,
    encode_frame,
    read_frame,
)
from gateway.workers.backoff import Backoff
from gateway.workers.events import Placement, WorkerDied, WorkerEvents, ended
from gateway.workers.output_stream import OutputStream

log = logging.getLogger(__name__)
_START_PREFIX = START_ERROR_PREFIX.encode()
__all__ = ["Placement", "WorkerDied", "WorkerEvents", "WorkerHandle", "ended", "supervise"]


class WorkerHandle:
    supervised = True  # `supervise` restarts it after a death

    def __init__(self, index: int, argv: list[str], env: dict | None = None,
                 ready_timeout: float = 300.0, events: WorkerEvents | None = None):
        self.index = index
        self.events = events or WorkerEvents()
        self.argv = argv
        self.env = env
        self.ready_timeout = ready_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.info: Ready | None = None  # the worker's facts, once it said ready
        self.stats: dict = {}
        self.inflight: dict[str, Placement] = {}  # engine request id -> its placement
        self.pending_blocks = 0  # prompt blocks dispatched but not yet seen in stats
        self.ready = asyncio.Event()
        self.restarts = 0
        self.started_at = 0.0
        self._reader: asyncio.Task | None = None
        self._stderr: asyncio.Task | None = None
        self._start_line = ""
        self.start_error: str | None = None  # why it cannot start (its StartError line)
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the worker and wait for its Ready frame. A worker that cannot start (its model
        does not load, a setting this machine cannot serve) exits with START_ERROR_EXIT after
        one stderr line: that raises StartError with the line (kept in `start_error`), and a
        worker that was never ready is not restarted."""
        self.ready.clear()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.transport.worker", *self.argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, **(self.env or {})},
            limit=64 << 20)
        self._stderr = asyncio.create_task(self._forward_stderr(self.proc.stderr),
                                           name=f"worker-{self.index}-stderr")
        try:
            message = await asyncio.wait_for(read_frame(self.proc.stdout), self.ready_timeout)
        except BaseException:
            self.proc.kill()
            await self.proc.wait()
            raise
        if not isinstance(message, Ready):
            await self.proc.wait()
            if self.proc.returncode == START_ERROR_EXIT:
                try:  # its last line, once the pipe closes
                    await asyncio.wait_for(asyncio.shield(self._stderr), 2.0)
                except TimeoutError:
                    pass
                self.start_error = self._start_line or f"worker {self.index} cannot start"
                raise StartError(self.start_error)
            raise RuntimeError(f"worker {self.index} did not start (exit {self.proc.returncode})")
        self._mark_ready(message, self._read_loop())

    async def _forward_stderr(self, stream: asyncio.StreamReader) -> None:
        """Copy the worker's stderr to ours, except its start-error line, which is kept."""
        out = getattr(sys.stderr, "buffer", None)
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the limit: pass on what there is
                line = await stream.read(1 << 16)
            if not line:
                return
            if line.startswith(_START_PREFIX):
                self._start_line = line[len(_START_PREFIX):].decode(errors="replace").strip()
                continue
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))

    def _mark_ready(self, message: Ready, reader, name: str = "reader") -> None:
        """The worker said ready: keep its facts, start reading its outputs, tell the app."""
        self.info = message
        self.started_at = time.monotonic()
        self._reader = asyncio.create_task(reader, name=f"worker-{self.index}-{name}")
        self.ready.set()
        self.events.ready(self)

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self._send(Shutdown())
            await asyncio.wait_for(self.proc.wait(), timeout)
        except (TimeoutError, ConnectionError):
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._stderr is not None:  # its last lines reach our log before we exit
            try:
                await asyncio.wait_for(asyncio.shield(self._stderr), 2.0)
            except TimeoutError:
                pass

    def kill(self) -> None:
        """Stop at once, with no restart (the supervisor skips a closing worker)."""
        self._closing = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def needs_restart(self) -> bool:
        """Its process died on its own: `supervise` starts a fresh one."""
        return self.proc is not None and self.proc.returncode is not None \
            and not self.ready.is_set() and not self._closing \
            and not (self.start_error and self.info is None)  # never started: it never will

    # ---- requests -----------------------------------------------------------------------
    def submit(self, messages: list[AddRequest], stream: OutputStream, priority: int,
               num_prompt_tokens: int) -> None:
        """Send the "add" frames of one job's sub-requests, all or none; their outputs arrive
        on `stream`. Every frame is encoded first (raising ProtocolError or TypeError for one
        that cannot be), so a refused job leaves nothing counted as in flight here."""
        if not self.alive:
            raise WorkerDied(f"worker {self.index} is not running")
        payloads = [self._encode(m) for m in messages]
        for m in messages:
            self.adopt(m.id, stream, priority, num_prompt_tokens)
        try:
            for payload in payloads:
                self._write(payload)
        except (ConnectionError, RuntimeError) as exc:  # the pipe broke under us
            for m in messages:
                self.release(m.id)
            raise WorkerDied(f"worker {self.index}: {exc}") from exc

    def adopt(self, request_id: str, stream: OutputStream, priority: int,
              num_prompt_tokens: int) -> None:
        """Count a request as in flight here (its frame is sent by the caller)."""
        self.inflight[request_id] = Placement(stream, priority, num_prompt_tokens)
        self.pending_blocks += self.blocks_for(num_prompt_tokens)

    def send_message(self, message: Frame) -> None:
        if not self.alive:
            raise WorkerDied(f"worker {self.index} is not running")
        self._send(message)

    def abort(self, request_id: str) -> None:
        """Ask the worker to drop a request; its final output still arrives (and is billed)."""
        if request_id in self.inflight and self.alive:
            self._send(AbortRequest(request_id))

    def _abort_stream(self, stream) -> None:
        """A client left too much output unread: abort every request feeding its stream."""
        for request_id in [r for r, p in self.inflight.items() if p.stream is stream]:
            log.warning("request %s: its client is not reading; aborting it", request_id)
            self.abort(request_id)

    def release(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

    # ---- load ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def block_size(self) -> int:
        return self.info.block_size if self.info is not None else 16

    @property
    def max_num_seqs(self) -> int:
        return self.info.max_num_seqs if self.info is not None else 0

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks if self.info is not None else 0

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens (prompt plus max_tokens) one request can hold here, from the Ready
        frame; 0 when unknown. The service refuses larger requests before queueing them."""
        return self.info.kv_capacity_tokens if self.info is not None else 0

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def free_slots(self) -> int:
        return self.max_num_seqs - len(self.inflight)

    @property
    def free_blocks(self) -> int:
        total = self.stats.get("kv_blocks_total", self.num_blocks)
        return total - self.stats.get("kv_blocks_used", 0) - self.pending_blocks

    @property
    def load(self) -> float:
        """Fraction of the worker's request slots in use (0 idle, 1 full)."""
        return len(self.inflight) / max(1, self.max_num_seqs)

    @property
    def prefill_load(self) -> float:
        """Prompt tokens in flight as a fraction of the KV capacity (prefill workers)."""
        capacity = self.num_blocks * self.block_size
        return sum(p.num_prompt_tokens for p in self.inflight.values()) / max(1, capacity)

    @property
    def kv_usage(self) -> float:
        total = self.stats.get("kv_blocks_total", self.num_blocks)
        return 1.0 - self.free_blocks / max(1, total)

    def least_urgent_priority(self) -> int | None:
        return max((p.priority for p in self.inflight.values()), default=None)

    # ---- frames -------------------------------------------------------------------------
    def _send(self, message: Frame) -> None:
        self._write(self._encode(message))

    def _encode(self, message: Frame):
        return encode_frame(message)

    def _write(self, payload) -> None:
        self.proc.stdin.write(payload)

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

    def _handle(self, frame: Frame) -> None:
        match frame:
            case Step(outputs=outputs, stats=stats):
                if stats:
                    self.stats = stats
                    self.pending_blocks = 0
                for out in outputs:
                    self._deliver(out)
            case IdleStats(stats=stats):
                self.stats = stats
                self.pending_blocks = 0
            case Rejected(id=request_id):
                self._end(request_id, "rejected", frame)
            case KvEvents():
                self.events.on_kv_events(self, frame)
            case TransferDone():
                self.events.transferred(self, frame)
            case ImportFailed(id=request_id, error=error):
                self._end(request_id, "error", WorkerDied(
                    f"KV transfer to worker {self.index} failed: {error}", request_id))

    def _deliver(self, out: Output) -> None:
        """One request's output: metered first, then to its stream; the last one frees it."""
        self.events.output(self, out)
        placed = self.inflight.get(out["id"])
        if placed is not None and placed.stream.put_nowait(out) and not out["finished"]:
            self._abort_stream(placed.stream)
        if out["finished"]:
            self.release(out["id"])
        elif out.get("prefilled") is not None and placed is not None:
            self.events.prefilled(self, out)

    def _end(self, request_id: str, reason: str, item) -> None:
        """The request ends here with nothing to bill: meter it, free it, wake its reader."""
        placed = self.inflight.get(request_id)
        self.events.output(self, ended(request_id, reason))
        self.release(request_id)
        if placed is not None:
            placed.stream.put_nowait(item)

    def _on_death(self) -> None:
        code = self.proc.returncode
        if not self._closing:
            log.error("worker %d (pid %s) exited with %s; %d requests failed",
                      self.index, self.pid, code, len(self.inflight))
        self._lose(f"worker {self.index} exited with code {code}")

    def _lose(self, why: str) -> None:
        """The worker is gone: every request in flight fails (metered as an error, nothing
        billed), and its prefix cache counts as empty until it says otherwise."""
        self.ready.clear()
        for rid, placed in list(self.inflight.items()):
            self.events.output(self, ended(rid, "error"))
            placed.stream.put_nowait(WorkerDied(why, rid))
        self.inflight.clear()
        self.pending_blocks = 0
        self.events.on_kv_events(self, KvEvents((), (), cleared=True))


async def supervise(handle: WorkerHandle, stop: asyncio.Event, max_backoff: float = 10.0):
    """Keep a started worker running: after a death, start a fresh one with backoff. A
    handle that comes back on its own (a shared worker reconnects) needs no supervisor."""
    if not handle.supervised:
        return
    backoff = Backoff(most=max_backoff)
    while not stop.is_set():
        if not handle.needs_restart:
            await asyncio.sleep(0.05)
            continue
        try:
            await handle.start()
            handle.restarts += 1
            backoff.reset()
        except Exception as exc:  # noqa: BLE001 - keep trying; the gateway stays up
            delay = backoff.next()
            log.error("worker %d failed to start: %s; retrying in %.1fs", handle.index, exc,
                      delay)
            await asyncio.sleep(delay)
