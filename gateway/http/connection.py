"""The HTTP connection layer: OpenAI error bodies before the app runs, and a header deadline.

aiohttp answers a request its parser refuses (500 headers, a 20 kB header line or URL) with a
plain-text 400 before any middleware sees it, and it has no limit on how long a client may
take to send its headers, so a slow-loris holds a connection for as long as it trickles.
`GatewayRequestHandler` answers parser errors with the OpenAI error body and a status that
names the problem (414 for the request line, 431 for headers), and cuts a connection whose
request head is not complete within `header_timeout` seconds with 408. `GatewayRunner` is
`web.AppRunner` with that handler as the protocol.

The handler reads two pieces of aiohttp's connection state (`_messages`: parsed requests not
yet handled; `_request_in_progress`); `tests/reliability/test_hostile_input.py` fails if an
aiohttp upgrade changes them.
"""
from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from gateway.errors import error_body
from gateway.http.error_middleware import json_response

log = logging.getLogger(__name__)

def parser_error(exc: BaseException | None, status: int,
                 request_line_bytes: int = 0) -> tuple[int, dict]:
    """(status, OpenAI error body) for a request aiohttp could not parse or handle.

    `request_line_bytes` is the length of the head's first line, which tells a URL over the
    line limit (414) from a header line over it (431).
    """
    if status >= 500:
        return status, error_body("internal server error", "server_error")
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else 8190
        if request_line_bytes > limit:
            return 414, error_body(f"the request line is over the limit of {limit} bytes",
                                   "invalid_request_error", code="uri_too_long")
        return 431, error_body(f"a request header line is over the limit of {limit} bytes",
                               "invalid_request_error", code="header_too_large")
    if isinstance(exc, BadHttpMessage) and "too many headers" in exc.message.lower():
        return 431, error_body("too many request headers", "invalid_request_error",
                               code="too_many_headers")
    message = exc.message if isinstance(exc, BadHttpMessage) else "malformed HTTP request"
    return 400, error_body(f"malformed HTTP request: {message}", "invalid_request_error",
                           code="bad_http_request")


def raw_response(status: int, body: dict) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for use before any request."""
    payload = orjson.dumps(body)
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n")
    return head.encode("ascii") + payload


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection handler with OpenAI error bodies and a request-head deadline."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        self._reading_head = False
        self._head_started = 0.0
        self._request_line_bytes = 0  # of the head being read: up to its first newline
        self._request_line_ended = False

    def data_received(self, data: bytes) -> None:
        # the clock starts with the first byte of a request head and stops when the whole
        # head is parsed; bytes of a body in flight fall under the body timeout instead
        if not self._reading_head and not self._request_in_progress and not self._messages:
            self._reading_head = True
            self._head_started = self._loop.time()
            self._request_line_bytes, self._request_line_ended = 0, False
        if self._reading_head and not self._request_line_ended:
            end = data.find(b"\n")
            self._request_line_ended = end >= 0
            self._request_line_bytes += end if end >= 0 else len(data)
        super().data_received(data)
        if not self._reading_head:
            return
        if self._messages or self._request_in_progress:
            self._reading_head = False
            self._stop_header_deadline()
        elif self._header_deadline is None and self._header_timeout > 0:
            # only a head split over packets needs a timer: most arrive whole
            self._header_deadline = self._loop.call_at(
                self._head_started + self._header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._header_deadline = None
        if self._messages or self._request_in_progress or self.transport is None:
            return  # the head completed in the same loop turn
        log.info("request head not complete within %.0f s: closing the connection",
                 self._header_timeout)
        self.transport.write(raw_response(408, error_body(
            f"the request head was not complete within {self._header_timeout:g} s",
            "invalid_request_error", code="header_timeout")))
        self.force_close()

    def _stop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            self._stop_header_deadline()
        finally:  # aiohttp's part cancels the handler, and with it the connection's requests
            super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of a response is out: only closing is left
            raise ConnectionError("response already started; cannot send an error")
        if status >= 500:
            log.error("error handling %s", request.remote, exc_info=exc)
        else:
            log.debug("refused a malformed request from %s: %s", request.remote, exc)
        status, body = parser_error(exc, status, self._request_line_bytes)
        response = json_response(body, status)
        response.force_close()
        return response


class GatewayServer(web.Server):
    """aiohttp's low-level server, making `GatewayRequestHandler` connections."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout

    def __call__(self) -> RequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, header_timeout=self.header_timeout,
                                     **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` serving the app through `GatewayServer`."""

    def __init__(self, app: web.Application, *, header_timeout: float, **kwargs):
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # runs the app's startup hooks
        return GatewayServer(base.request_handler, request_factory=base.request_factory,
                             handler_cancellation=base.handler_cancellation,
                             header_timeout=self.header_timeout, **base._kwargs)
