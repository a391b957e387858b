"""Reading a request: its JSON body (415, 413, 408 and 400 as OpenAI error bodies), the
client's trace context, and the frame every generation handler runs in.

A body may cost far more to decode and validate than to send: 4 MiB of `[[],[],...]` is 1.4M
lists to build, 2,048 messages of 64 parts are 131k objects to validate, a tool's schema costs
about 4 us a byte to check. So the caps apply first (on the raw bytes here, across fields in the
declared models), and a body over `INLINE_BYTES`, or one carrying schemas, is decoded and
validated on `BODY_POOL`, off the event loop every client's stream shares. The pool is small:
its threads still take turns at the interpreter lock with the loop, and more of them would only
make each turn of the loop's wait longer.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from billing.keys import ApiKey
from gateway.errors import APIError, bad_request
from gateway.http.auth import authenticate
from gateway.serving.admission import charged
from gateway.state import STATE, GatewayState

T = TypeVar("T")
BODY_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="body")
# up to this many bytes a body is decoded and validated on the loop: well under a millisecond
# of work, cheaper than the hop to the pool (a body with schemas goes there whatever its size)
INLINE_BYTES = 16 << 10
# arrays and objects one body may hold, counted as `[` and `{` bytes (strings' too, so a count
# over it may be text: no prompt that long fits any context we serve). orjson builds them
# holding the interpreter lock, on the pool or not: this bounds that hold to ~25 ms
MAX_BODY_CONTAINERS = 1 << 18
SCHEMA_FIELDS = ("tools", "response_format", "structured_outputs", "guided_json")
BODY_BYTES = web.RequestKey("body_bytes", int)  # the raw body's size, once read


def trace_context(request: web.Request) -> dict | None:
    """The client's W3C trace context, continued by the request's span."""
    headers = {k: request.headers[k] for k in ("traceparent", "tracestate")
               if k in request.headers}
    return headers or None


async def read_json(request: web.Request, timeout: float | None = None):
    """The decoded body, for every route that takes one: 415 unless sent as JSON (a web page
    can post text/plain to a local gateway without asking first), 413 over the limit, 408 if
    it trickles in slower than `timeout`, 400 for a body its Content-Encoding does not decode
    or that is not JSON (nesting deeper than orjson's 1,024 levels included)."""
    if request.content_type != "application/json":
        raise APIError(415, f"the body must be sent as Content-Type: application/json, not "
                       f"{request.headers.get('Content-Type', 'none')[:100]!r}",
                       code="unsupported_media_type")
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # over client_max_size: 413
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="body_timeout") from None
    except RequestPayloadError as exc:  # e.g. marked gzip but not gzip
        encoding = request.headers.get("Content-Encoding", "none")[:50]
        raise bad_request(f"the body could not be decoded as Content-Encoding {encoding!r}",
                          code="invalid_body_encoding") from exc
    request[BODY_BYTES] = len(raw)
    return await decode_sized(raw)


def decode(raw: bytes) -> Any:
    """The JSON of `raw` (400 unless JSON), refused unbuilt when it holds more arrays and
    objects than any request needs (`MAX_BODY_CONTAINERS`)."""
    if len(raw) > MAX_BODY_CONTAINERS and \
            raw.count(b"[") + raw.count(b"{") > MAX_BODY_CONTAINERS:  # ~1 ms a MiB
        raise bad_request(f"the body holds more than {MAX_BODY_CONTAINERS} JSON arrays and "
                          "objects", code="body_too_complex")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the body pool, awaited."""
    return await asyncio.get_running_loop().run_in_executor(
        BODY_POOL, functools.partial(fn, *args))


async def validate(request: web.Request, body: Any, fn: Callable[..., T], *args: Any) -> T:
    """`fn(body, *args)`, an HTTP body's validation (`validate_sized`)."""
    return await validate_sized(request.get(BODY_BYTES, 0), body, fn, *args)


async def validate_sized(nbytes: int, body: Any, fn: Callable[..., T], *args: Any) -> T:
    """`fn(body, *args)` for a body that arrived as `nbytes`: on the loop when small and
    without schemas, else on the body pool (see the module's note). HTTP bodies, WebSocket
    messages and the Responses API's chat bodies all come through here."""
    has_schemas = isinstance(body, dict) and any(body.get(f) for f in SCHEMA_FIELDS)
    if not has_schemas and nbytes <= INLINE_BYTES:
        return fn(body, *args)
    return await off_loop(fn, body, *args)


async def decode_sized(raw: bytes | str) -> Any:
    """`decode(raw)`, on the body pool when `raw` is large (a WebSocket message, say)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) <= INLINE_BYTES:
        return decode(data)
    return await off_loop(decode, data)


@asynccontextmanager
async def generation(request: web.Request) -> AsyncIterator[tuple[GatewayState, ApiKey, Any]]:
    """(state, key, body) for a handler that generates: the key checked (401), a worker ready
    and no drain under way (503), the tenant's requests per minute charged (429), and only
    then the body read, so that a body refused for any reason still costs its sender a
    request; the handler counts as in flight, so a drain waits for it, until it returns."""
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    state.require_service()
    state.request_started()
    try:
        async with charged(state, key):
            yield state, key, await read_json(request, state.config.body_timeout_seconds)
    finally:
        state.request_ended()
