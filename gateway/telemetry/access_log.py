"""The access log (one line per HTTP request, on the logger "gateway.access") and the periodic
throughput summary (on "gateway.summary").

A middleware, outermost of all, times every request and logs it once it ends, with the status
the client got (refusals included: the error middleware has already turned them into
responses). A generation request answers with `x-request-id`; its settled `RequestFinished`
(kept here, keyed by that id, by an accounting subscriber, which runs before the handler
returns) gives the tenant, the token counts and the TTFT. Other requests name the tenant of
the key they presented, when it is a valid one. Text lines read
`METHOD PATH STATUS tenant=.. prompt=.. cached=.. output=.. ttft_ms=.. ms=..` (`-`: not
known); with `--log-format json` each line is one JSON object. A handler cancelled because
its client went away is logged with status 499.

The summary (every `--log-summary-seconds`, only after a window with traffic) gives requests
per second, output tokens per second, the queue's length, KV cache use and the cache-hit rate
of the window's prompts.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from billing.request_finished import RequestFinished

if TYPE_CHECKING:
    from gateway.state import GatewayState

access_log = logging.getLogger("gateway.access")
summary_log = logging.getLogger("gateway.summary")
FORMATS = ("text", "json")
PROBES = frozenset({"/health", "/ready", "/metrics"})  # not traffic for the summary
KEEP_SETTLED = 4096  # settled records not (yet) claimed by a request: WebSocket ones, say
CLIENT_GONE = 499  # the handler was cancelled: the client disconnected


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test harness may swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure(logger: logging.Logger, fmt: str) -> None:
    """Give the logger its own stderr handler (unless an operator configured one), so that its
    lines appear whatever the root logger does, and JSON lines stay bare."""
    logger.setLevel(logging.INFO)
    ours = [h for h in logger.handlers if getattr(h, "_inferstack", False)]
    for h in ours:  # a second app in this process (tests): its format wins
        h.setFormatter(_formatter(fmt))
    if ours or logger.handlers:
        return
    handler = _Stderr()
    handler._inferstack = True  # type: ignore[attr-defined]
    handler.setFormatter(_formatter(fmt))
    logger.addHandler(handler)
    logger.propagate = False


def _formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return logging.Formatter("%(message)s")
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


class AccessLog:
    """The middleware, the accounting subscriber and the summary loop, sharing one window."""

    def __init__(self, state: GatewayState, presented_key: Callable[[web.Request], str | None]):
        config = state.config
        if config.log_format not in FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, "
                             f"not {config.log_format!r}")
        self.state = state
        self.presented_key = presented_key
        self.enabled = config.access_log
        self.json = config.log_format == "json"
        self.interval = config.log_summary_seconds
        self.settled: OrderedDict[str, RequestFinished] = OrderedDict()
        self._reset_window()
        fmt = config.log_format
        if self.enabled:
            _configure(access_log, fmt)
        if self.interval > 0:
            _configure(summary_log, fmt)

    # ---- the accounting subscriber ------------------------------------------------------
    def on_settled(self, done: RequestFinished) -> None:
        self.settled[done.request_id] = done
        while len(self.settled) > KEEP_SETTLED:
            self.settled.popitem(last=False)
        self.w_generations += 1
        self.w_output += done.completion_tokens
        self.w_prompt += done.prompt_tokens
        self.w_cached += done.cached_tokens

    # ---- the middleware -----------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler):
        started = time.monotonic()
        status = 500
        response = None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:  # redirects and the like, past the error middleware
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            self._ended(request, response, status, time.monotonic() - started)

    def _ended(self, request: web.Request, response, status: int, seconds: float) -> None:
        if request.path not in PROBES:
            self.w_requests += 1
        if not self.enabled:
            return
        try:
            request_id = response.headers.get("x-request-id") if response is not None else None
            done = self.settled.pop(request_id, None) if request_id else None
            tenant = done.tenant if done is not None else self._tenant(request)
            ttft = done.ttft_seconds if done is not None else None
            fields = {
                "method": request.method, "path": request.path, "status": status,
                "tenant": tenant, "request_id": request_id,
                "prompt": done.prompt_tokens if done is not None else None,
                "cached": done.cached_tokens if done is not None else None,
                "output": done.completion_tokens if done is not None else None,
                "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
                "ms": round(seconds * 1000, 1)}
            access_log.info(self._line(fields))
        except Exception:  # noqa: BLE001 - the log never fails a request
            access_log.exception("access log line for %s %s", request.method, request.path)

    def _tenant(self, request: web.Request) -> str | None:
        keys = self.state.keys
        if keys is None:
            return "default"
        secret = self.presented_key(request)
        key = keys.lookup(secret) if secret else None
        return key.tenant.name if key is not None else None

    def _line(self, fields: dict) -> str:
        if self.json:
            return orjson.dumps({"time": time.time(), "type": "access", **fields}).decode()
        head = f"{fields['method']} {fields['path']} {fields['status']}"
        rest = " ".join(f"{k}={'-' if fields[k] is None else fields[k]}"
                        for k in ("tenant", "prompt", "cached", "output", "ttft_ms", "ms"))
        return f"{head} {rest}"

    # ---- the summary --------------------------------------------------------------------
    def _reset_window(self) -> None:
        self.w_requests = self.w_generations = 0
        self.w_output = self.w_prompt = self.w_cached = 0
        self.w_started = time.monotonic()

    def summary(self) -> dict | None:
        """The window's summary (and a new window), or None when it had no traffic."""
        now = time.monotonic()
        span = max(1e-9, now - self.w_started)
        queue = len(self.state.queue)
        if not (self.w_requests or self.w_generations or queue):
            self._reset_window()
            return None
        used = total = 0
        for w in self.state.workers:
            if w.alive:
                used += w.stats.get("kv_blocks_used", 0)
                total += w.stats.get("kv_blocks_total", 0)
        out = {"requests_per_s": round(self.w_requests / span, 2),
               "generations_per_s": round(self.w_generations / span, 2),
               "output_tokens_per_s": round(self.w_output / span, 1),
               "queue": queue, "running": self.state.active_requests,
               "kv_use": round(used / total, 3) if total else None,
               "cache_hit_rate": round(self.w_cached / self.w_prompt, 3) if self.w_prompt
               else None}
        self._reset_window()
        return out

    def summary_line(self, s: dict) -> str:
        if self.json:
            return orjson.dumps({"time": time.time(), "type": "summary", **s}).decode()
        kv = "-" if s["kv_use"] is None else f"{100 * s['kv_use']:.1f}%"
        hit = "-" if s["cache_hit_rate"] is None else f"{100 * s['cache_hit_rate']:.1f}%"
        return (f"summary req/s={s['requests_per_s']} gen/s={s['generations_per_s']} "
                f"out_tok/s={s['output_tokens_per_s']} queue={s['queue']} "
                f"running={s['running']} kv={kv} cache_hit={hit}")

    async def run(self, stop: asyncio.Event) -> None:
        """A summary line every `interval` seconds that had traffic, until `stop`."""
        if self.interval <= 0:
            return
        self._reset_window()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            s = self.summary()
            if s is not None:
                summary_log.info(self.summary_line(s))


ACCESS_LOG = web.AppKey("access_log", AccessLog)


def install(app: web.Application, state: GatewayState,
            presented_key: Callable[[web.Request], str | None]) -> None:
    """Put the access log outermost of the app's middlewares and subscribe it to the
    accounting; nothing when both the access log and the summary are off."""
    if not (state.config.access_log or state.config.log_summary_seconds > 0):
        return
    access = AccessLog(state, presented_key)
    app[ACCESS_LOG] = access
    app.middlewares.insert(0, access.middleware)
    state.accounting.subscribe(access.on_settled)


def summary_task(app: web.Application, stop: asyncio.Event) -> list[asyncio.Task]:
    """The summary loop's task, for the app's lifecycle (none when it is off)."""
    access = app.get(ACCESS_LOG)
    if access is None or access.interval <= 0:
        return []
    return [asyncio.create_task(access.run(stop), name="log-summary")]
