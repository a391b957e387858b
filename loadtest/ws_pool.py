"""Our gateway's multiplexed WebSocket (/v1/ws): a pool of sockets per API key, each carrying
up to `per_socket` requests at once, a reader task per socket routing frames by request id.

Frames: the client sends {"type": "request", "id", "endpoint", "body"}; the server answers
"queued" (ignored), "chunk" (data: the SSE chunk), "done" (usage) or "error". A socket that
closes under a request truncates it.
"""
from __future__ import annotations

import asyncio
import itertools

import aiohttp
import orjson

from loadtest.record import RequestRecord
from loadtest.stream import ChunkReader

_CLOSED = object()


class _Socket:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, now):
        self.ws, self.now = ws, now
        self.pending: dict[str, asyncio.Queue] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                t = self.now()
                if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    continue
                try:
                    frame = orjson.loads(msg.data)
                    q = self.pending.get(frame.get("id"))
                except (orjson.JSONDecodeError, AttributeError):
                    frame, q = None, None
                if frame is None:  # a bad frame cannot be routed: it fails every request
                    for q in self.pending.values():
                        q.put_nowait((t, {"type": "bad_frame"}))
                elif q is not None:
                    q.put_nowait((t, frame))
        finally:
            for q in self.pending.values():
                q.put_nowait((self.now(), _CLOSED))


class WSPool:
    def __init__(self, session: aiohttp.ClientSession, url: str, now, per_socket: int = 64):
        self.session, self.url, self.now, self.per_socket = session, url, now, per_socket
        self.sockets: dict[str | None, list[_Socket]] = {}
        self.ids = itertools.count()
        self.lock = asyncio.Lock()

    async def _socket(self, api_key: str | None) -> _Socket:
        async with self.lock:
            pool = self.sockets.setdefault(api_key, [])
            pool[:] = [s for s in pool if not s.ws.closed]
            for s in pool:
                if len(s.pending) < self.per_socket:
                    return s
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            ws = await self.session.ws_connect(self.url, headers=headers, max_msg_size=0,
                                               autoping=True)
            sock = _Socket(ws, self.now)
            pool.append(sock)
            return sock

    async def request(self, api_key, endpoint: str, body: dict, rec: RequestRecord,
                      reader: ChunkReader) -> None:
        sock = await self._socket(api_key)
        rid = f"r{next(self.ids)}"
        q: asyncio.Queue = asyncio.Queue()
        sock.pending[rid] = q
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            rec.sent = self.now()
            await sock.ws.send_bytes(orjson.dumps({"type": "request", "id": rid,
                                                   "endpoint": endpoint, "body": body}))
            rec.status = 101
            await self._receive(q, rec, reader)
        finally:
            sock.pending.pop(rid, None)

    async def _receive(self, q: asyncio.Queue, rec: RequestRecord, reader: ChunkReader) -> None:
        while True:
            t, frame = await q.get()
            if frame is _CLOSED:
                reader.fail("truncated", "the socket closed before the request was done")
                return reader.close(t)
            kind = frame.get("type")
            if kind == "chunk":
                reader.feed(t, frame.get("data"))
            elif kind == "done":
                rec.usage = frame.get("usage") or rec.usage
                return reader.close(t)
            elif kind == "error":
                err = frame.get("error") or {}
                reader.fail("stream_error", err.get("message") if isinstance(err, dict)
                            else str(err))
                return reader.close(t)
            elif kind == "bad_frame":
                reader.fail("bad_frame", "a frame that is not JSON")
                return reader.close(t)
            if rec.error:
                return reader.close(t)

    async def close(self) -> None:
        for pool in self.sockets.values():
            for s in pool:
                await s.ws.close()
                s.reader.cancel()
