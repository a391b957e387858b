"""An SSE answer of named events (`event: <type>` lines, each event's own `type`), opened at its
first write: how the Responses API and Anthropic's Messages API stream. Opening lazily keeps a
refusal before the first event a plain HTTP error with its status; once open, an error becomes
the API's own failure events. The keep-alive guard, the open-responses registry (drained at
shutdown) and the final response are handled here once for both."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from gateway.errors import APIError
from gateway.http.completions import StreamGuard, response_headers
from gateway.http.sse import SSEStream, encode_named_event
from gateway.serving.inflight import InFlightRequest
from gateway.state import GatewayState


def encode(events: list[dict]) -> bytes:
    return b"".join(encode_named_event(e["type"], e) for e in events)


class NamedEventStream:
    """One streamed answer: subclasses say what the stream sends (`_stream`), how it keeps the
    connection alive (`keepalive`) and how a failure after the opening reads (`_failure`)."""

    def __init__(self, request: web.Request, state: GatewayState, gen: InFlightRequest,
                 opening: Callable[[], list[dict]]):
        self.request, self.state, self.gen = request, state, gen
        self._opening_events = opening  # the events sent first, once the stream opens
        self.sse: SSEStream | None = None
        self.opening = asyncio.Lock()

    async def open(self) -> SSEStream:
        async with self.opening:  # the keep-alive task may race the first delta
            if self.sse is None:
                sse = await SSEStream.open(self.request, response_headers(self.gen))
                self.state.open_responses.add(sse.response)
                self.sse = sse
                await sse.send_bytes(encode(self._opening_events()))
        return self.sse

    async def send_events(self, events: list[dict]) -> bool:
        """Send events after the opening ones; False when the client is gone."""
        sse = await self.open()
        if not events:
            return not sse.closed
        return await sse.send_bytes(encode(events))

    async def run(self) -> web.StreamResponse:
        config = self.state.config
        guard = StreamGuard(config.keepalive_seconds, config.send_timeout_seconds,
                            self.keepalive, lambda: self.sse)
        try:
            await self._stream(guard)
            return (await self.open()).response
        except APIError as exc:
            if self.sse is None:
                raise
            await self.sse.send_bytes(encode(self._failure(exc)))
            return self.sse.response
        finally:
            await guard.stop()
            if self.sse is not None:
                self.state.open_responses.discard(self.sse.response)

    async def keepalive(self) -> bool:
        raise NotImplementedError

    async def _stream(self, guard: StreamGuard) -> None:
        raise NotImplementedError

    def _failure(self, exc: APIError) -> list[dict]:
        raise NotImplementedError
