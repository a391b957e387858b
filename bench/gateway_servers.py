"""The servers bench/gateway.py measures: the bare aiohttp SSE reference server with the fake
engine's step cadence, and a server started in its own process group and waited on until ready.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from bench.processes import process_tree

REPO_ROOT = Path(__file__).resolve().parent.parent

# The fake engine's token cycle (runtime/fake_engine.py WORDS, as the SmolLM2 tokenizer splits it).
WORDS = [" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", " and",
         " keeps", " running", " through", " the", " field", "."]
MODEL = "fake-smollm2"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "Connection": "keep-alive", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


# ---- the bare reference server ------------------------------------------------------------
class _BareStream:
    __slots__ = ("id", "created", "max_tokens", "sent", "queue")

    def __init__(self, max_tokens: int):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.max_tokens = max_tokens
        self.sent = 0
        self.queue: asyncio.Queue = asyncio.Queue()


def serve_bare(port: int, step_ms: float) -> None:
    """A minimal OpenAI-style completion SSE server with the fake engine's batch-step cadence."""
    import orjson
    import uvloop
    from aiohttp import web

    step = step_ms / 1000.0
    streams: dict[int, _BareStream] = {}
    wake = asyncio.Event()

    def event(s: _BareStream, text: str, finish: str | None) -> bytes:
        return b"data: " + orjson.dumps(
            {"id": s.id, "object": "text_completion", "created": s.created, "model": MODEL,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish}]}) + b"\n\n"

    async def ticker() -> None:
        while True:
            if not streams:
                wake.clear()
                await wake.wait()
            batch = list(streams.values())  # the requests "running" in this step
            await asyncio.sleep(step)
            for s in batch:
                s.queue.put_nowait(event(s, WORDS[s.sent % len(WORDS)], None))
                s.sent += 1
                if s.sent >= s.max_tokens:
                    s.queue.put_nowait(event(s, "", "length"))
                    s.queue.put_nowait(DONE)
                    s.queue.put_nowait(None)
                    streams.pop(id(s), None)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        s = _BareStream(int(body.get("max_tokens") or 16))
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, "x-request-id": s.id})
        await response.prepare(request)
        streams[id(s)] = s
        wake.set()
        try:
            while (data := await s.queue.get()) is not None:
                await response.write(data)
        finally:
            streams.pop(id(s), None)
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ready")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/ready", ready)
        # the same runner and site settings as gateway/__main__.py
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        task = asyncio.create_task(ticker())
        try:
            await asyncio.Event().wait()
        finally:
            task.cancel()
            await runner.cleanup()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


# ---- server processes -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started in its own session; waits for GET `ready_path` == 200."""

    def __init__(self, name: str, argv: list[str], port: int, ready_timeout: float = 240.0,
                 ready_path: str = "/ready"):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        log = None if os.environ.get("BENCH_GATEWAY_LOG") else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} did not become ready")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's process tree (Linux /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in process_tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass

