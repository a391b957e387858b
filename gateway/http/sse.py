"""Server-sent events: the exact bytes of each event, and a stream that notices a gone client.

An event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`; a comment line keeps
idle connections (and the proxies between) from timing out. A client that disconnects shows up
as a failed write: `SSEStream` turns it into `closed = True` so the caller aborts the request
instead of handling an exception at every write.
"""
from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from gateway.http.hard_close import hard_close
from gateway.http.pending_writes import PendingWrites

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # nginx would otherwise hold tokens back in its buffer
}


def encode_event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def encode_named_event(name: str, obj) -> bytes:
    """An event with an `event:` line before its data, as the Responses API streams them
    (clients may dispatch on the name without parsing the JSON)."""
    return b"event: " + name.encode() + b"\n" + encode_event(obj)


async def open_sse(request: web.Request,
                   headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """Send the 200 and the SSE headers (plus `headers`, e.g. x-request-id) to the client."""
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


class SSEStream:
    """Writes events to one client; after the client goes, writes are no-ops and `closed` is set.

    Each write is one transport write of a whole event, so a keep-alive sent from another task
    can never land inside an event.
    """

    def __init__(self, response: web.StreamResponse, transport=None):
        self.response = response
        self.transport = transport
        self.closed = False
        self.pending = PendingWrites()

    @classmethod
    async def open(cls, request: web.Request,
                   headers: Mapping[str, str] | None = None) -> SSEStream:
        return cls(await open_sse(request, headers), request.transport)

    def abort(self) -> None:
        """Drop the connection now, unsent bytes included (a client that stopped reading
        would otherwise hold them, and the socket, until it reads)."""
        self.closed = True
        hard_close(self.transport)

    async def send(self, obj) -> bool:
        """Send one JSON event; False when the client is gone."""
        return await self.send_bytes(encode_event(obj))

    async def send_all(self, objs, done: bool = False) -> bool:
        """Send several JSON events in one write (a delta's role, text and finish chunks),
        then [DONE] if `done`."""
        return await self.send_bytes(b"".join(map(encode_event, objs)) + (DONE if done else b""))

    async def send_done(self) -> bool:
        return await self.send_bytes(DONE)

    async def keepalive(self) -> bool:
        return await self.send_bytes(KEEPALIVE)

    async def send_bytes(self, data: bytes) -> bool:
        if self.closed:
            return False
        try:
            with self.pending:  # at once, unless the client's buffer is full
                await self.response.write(data)
        except ConnectionError:  # reset or broken pipe: the client went away mid-stream
            self.closed = True
        return not self.closed
