"""An asyncio face for the engine: each request's outputs arrive as an async iterator.

The engine steps on its own thread (torch releases the GIL in its kernels), so the event loop
stays free. Only that thread touches engine state: adds and aborts travel to it as commands,
and outputs travel back with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from runtime.engine import LLMEngine
from runtime.errors import DuplicateRequestError
from runtime.outputs import RequestOutput, StepStats
from runtime.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread failed; every open request ends with this error."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_stats: StepStats | None = None
        self.error: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (raising typed errors before anything is queued), then stream outputs.

        Leaving the iteration early (break, cancellation, a closed client) aborts the request.
        """
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is in flight",
                                        param="request_id")
        self.engine.validate(request_id, prompt_token_ids, params, priority, cache_salt)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt_token_ids, params, priority, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ---- engine thread ------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs, stats = self.engine.step()
                self.last_stats = stats
                self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - every stream must learn of it
            self.error = exc
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, params, priority, salt = command
                try:
                    self.engine.add_request(rid, prompt, params, priority, salt)
                except Exception as exc:  # validated already; this is a race or a bug
                    self._deliver_to(rid, exc)
            else:
                final = self.engine.abort_request(command[1])
                if final is not None:
                    self._deliver([final])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver_to(out.request_id, out)

    def _deliver_to(self, request_id: str, item) -> None:
        def put() -> None:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)
        self._loop.call_soon_threadsafe(put)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver_to(rid, exc)
