"""Reading a request: its JSON body (415, 413, 408 and 400 as OpenAI error bodies), the
client's trace context, and the frame every generation handler runs in."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from billing.keys import ApiKey
from gateway.errors import APIError, bad_request
from gateway.http.auth import authenticate
from gateway.state import STATE, GatewayState


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
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None


@asynccontextmanager
async def generation(request: web.Request) -> AsyncIterator[tuple[GatewayState, ApiKey, Any]]:
    """(state, key, body) for a handler that generates: the key checked (401), a worker ready
    and no drain under way (503), then the body read; the handler counts as in flight, so a
    drain waits for it, until it returns."""
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    state.require_service()
    state.request_started()
    try:
        yield state, key, await read_json(request, state.config.body_timeout_seconds)
    finally:
        state.request_ended()
