"""GET /v1/ws: many requests over one WebSocket, each with a client-chosen id.

client -> server
  {"type": "request", "id": "a1", "endpoint": "chat" | "completions", "body": {...}}
  {"type": "cancel", "id": "a1"}
server -> client
  {"type": "queued", "id", "position"}     while it waits (sent when the position changes)
  {"type": "chunk", "id", "data": <the same chunk as the SSE stream>}
  {"type": "done", "id", "usage": {...}}
  {"type": "error", "id", "error": {"message", "type", "param", "code"}}
Bodies are the HTTP API's; "stream" is implied. Closing the socket cancels all its requests.

However the socket goes (the peer's close frame or EOF, a ping unanswered, writes stalled, the
handler cancelled), its requests are cancelled first and the socket closed after, so nothing a
close raises or waits on can leave them running.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import aclosing

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from gateway.errors import APIError, bad_request
from gateway.http.auth import authenticate
from gateway.http.completions import InterTokenClock, chunker_for, usage_of
from gateway.http.hard_close import hard_close
from gateway.http.pending_writes import PendingWrites
from gateway.http.request_body import decode_sized, validate_sized
from gateway.openai.requests import parse_request
from gateway.serving.accounting import wait_committed
from gateway.serving.admission import admit
from gateway.state import STATE

log = logging.getLogger(__name__)
MAX_REQUESTS_PER_SOCKET = 128
POSITION_INTERVAL = 0.25


class Connection:
    def __init__(self, ws: web.WebSocketResponse, state, key, transport=None):
        self.ws = ws
        self.state = state
        self.key = key  # authenticated once, at the upgrade
        self.transport = transport
        self.tasks: dict[str, asyncio.Task] = {}
        self.started: set[str] = set()  # ids whose task has begun to run
        self.pending = PendingWrites()
        self.closing = False  # the socket is going: its requests are cancelled, none answered

    async def send(self, message: dict) -> None:
        if self.closing or self.ws.closed:
            return
        try:
            with self.pending:
                await self.ws.send_bytes(orjson.dumps(message))
        except ConnectionError:
            pass

    async def watch_stalls(self, timeout: float) -> None:
        """Drop the socket when a write has waited `timeout` seconds on a peer that reads
        nothing: closing it ends every request on it, each billed for what it produced."""
        while not self.ws.closed:
            since = self.pending.since
            await asyncio.sleep(timeout / 4 if since is None else
                                max(0.0, since + timeout - time.monotonic()))
            if self.pending.stalled(timeout):
                log.warning("a WebSocket peer read nothing for %.0f s; dropping it", timeout)
                self.cancel_all()
                self.abort()
                return

    def cancel_all(self) -> None:
        """Cancel every request on the socket, which is going. Synchronous and raising
        nothing, so every drop path runs it before the close that may raise or wait."""
        self.closing = True
        for task in self.tasks.values():
            task.cancel()

    def abort(self) -> None:
        """Close the TCP connection now, unsent frames included (a plain close would wait
        for a peer that never reads to take them)."""
        hard_close(self.transport)

    async def error(self, rid, exc: APIError) -> None:
        await self.send({"type": "error", "id": rid, "error": exc.body()["error"]})

    async def handle(self, raw: bytes | str) -> None:
        if self.closing:  # messages read after the drop began would start orphans
            return None
        try:
            message = await decode_sized(raw)  # off the loop when large
        except APIError as exc:
            return await self.error(None, exc)
        if not isinstance(message, dict):
            return await self.error(None, bad_request("a message must be a JSON object"))
        rid, kind = message.get("id"), message.get("type")
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            return await self.error(None, bad_request("id must be a string of 1 to 256 "
                                                      "characters", param="id"))
        if kind == "cancel":
            return await self.cancel(rid)
        if kind != "request":
            return await self.error(rid, bad_request(f"unknown message type {kind!r}",
                                                     param="type"))
        if rid in self.tasks:
            return await self.error(rid, bad_request(f"id {rid!r} is already in flight",
                                                     param="id"))
        if len(self.tasks) >= MAX_REQUESTS_PER_SOCKET:
            return await self.error(rid, bad_request("too many requests in flight on this "
                                                     "socket"))
        self.tasks[rid] = asyncio.create_task(self.run(rid, message, len(raw)))
        return None

    async def cancel(self, rid: str) -> None:
        task = self.tasks.get(rid)
        if task is None:
            return
        task.cancel()
        if rid not in self.started:
            # cancelled before its first step, its coroutine never runs (not even run()'s
            # finally): its final message and its id's release are done here
            del self.tasks[rid]
            await self.send(cancelled(rid))

    async def run(self, rid: str, message: dict, nbytes: int) -> None:
        """One request of the socket, `message` its request message (`nbytes` long)."""
        self.started.add(rid)
        self.state.request_started()  # a drain waits for this request
        try:
            await self._run(rid, message, nbytes)
        except APIError as exc:
            await self.error(rid, exc)
        except asyncio.CancelledError:
            await self.send(cancelled(rid))
        finally:
            self.started.discard(rid)
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]
            self.state.request_ended()

    async def _run(self, rid: str, message: dict, nbytes: int) -> None:
        endpoint = message.get("endpoint", "chat")
        if endpoint not in ("chat", "completions"):
            raise bad_request("endpoint must be 'chat' or 'completions'", param="endpoint")
        body = message.get("body")
        if isinstance(body, dict):
            body = {**body, "stream": True}
        kind = "chat" if endpoint == "chat" else "completion"
        req = await validate_sized(nbytes, body, functools.partial(parse_request, kind),
                                   self.state.sampling_defaults)
        service = self.state.require_service()  # 503 until a worker is ready
        gen = await admit(self.state, self.key, req, body)
        watcher = asyncio.create_task(self._report_position(rid, gen))
        chunker = chunker_for(self.state, gen, include_usage=False)
        itl = InterTokenClock(self.state)
        # aclosing: a cancel landing in a send closes the stream (its finally aborts the
        # request) now, not when the garbage collector gets to the generator
        deltas = service.stream(gen)
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    watcher.cancel()
                    for chunk in chunker.chunks(delta):
                        await self.send({"type": "chunk", "id": rid, "data": chunk})
                    itl.tick(len(delta.token_ids))
        finally:
            watcher.cancel()
        await wait_committed(gen)  # the bill is durable before the client sees "done"
        gen.reasoning_tokens = chunker.reasoning_tokens
        await self.send({"type": "done", "id": rid, "usage": usage_of(gen)})

    async def _report_position(self, rid: str, gen) -> None:
        last = None
        queue = self.state.queue
        while gen.entry is not None and gen.entry.queued:
            position = queue.position(gen.entry)
            if position is not None and position != last:
                await self.send({"type": "queued", "id": rid, "position": position})
                last = position
            await asyncio.sleep(POSITION_INTERVAL)

    async def close(self, abort: bool) -> None:
        """End the socket's requests, then (`abort`) drop the socket, then wait for the
        requests' tasks, which send nothing now and so cannot wait on the peer."""
        tasks = list(self.tasks.values())
        self.cancel_all()  # first: nothing below may skip it
        try:
            if abort:
                self.abort()
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)


def cancelled(rid: str) -> dict:
    """The final message of a request ended by the client's cancel."""
    return {"type": "error", "id": rid, "error": {
        "message": "cancelled", "type": "cancelled", "param": None, "code": None}}


class GatewayWebSocket(web.WebSocketResponse):
    """aiohttp's WebSocket whose every close first cancels the socket's requests, and gives
    up on the peer after `close_timeout` seconds with a hard close.

    aiohttp closes from inside `receive()` (the peer's close frame, EOF, a protocol error)
    and marks the socket closed before a handshake that waits on the peer's reading; sends
    are dropped from then on, so without this the requests would run on unread to their end.
    """

    def __init__(self, *, close_timeout: float, **kwargs):
        super().__init__(**kwargs)
        self.close_timeout = close_timeout
        self.conn: Connection | None = None  # set once the upgrade is done

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"",
                    drain: bool = True) -> bool:
        conn = self.conn
        if conn is not None:
            conn.cancel_all()
        try:
            async with asyncio.timeout(self.close_timeout):
                return await super().close(code=code, message=message, drain=drain)
        except TimeoutError:  # a peer that does not read holds the handshake
            log.debug("a WebSocket close handshake took over %.0f s; dropping the peer",
                      self.close_timeout)
            if conn is not None:
                conn.abort()
            return True


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    key = authenticate(request, state.keys)  # 401 before the upgrade
    timeout = state.config.send_timeout_seconds
    # a ping unanswered for half the heartbeat marks the peer dead (aiohttp closes it)
    ws = GatewayWebSocket(max_msg_size=state.config.max_body_bytes, heartbeat=timeout or 30.0,
                          close_timeout=timeout or 30.0)
    await ws.prepare(request)
    conn = ws.conn = Connection(ws, state, key, request.transport)
    watcher = asyncio.create_task(conn.watch_stalls(timeout)) if timeout else None
    state.open_responses.add(ws)
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await conn.handle(msg.data)
            elif msg.type == WSMsgType.ERROR:
                break
    finally:
        state.open_responses.discard(ws)
        if watcher is not None:
            watcher.cancel()
        # no pong: a dead peer, whose unread buffer a plain close would wait on
        await conn.close(abort=isinstance(ws.exception(), asyncio.TimeoutError))
    return ws
