"""GET /admin/telemetry: the live feed over a WebSocket, for admin keys."""
from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from gateway.http.auth import authenticate, require_admin
from gateway.state import STATE


async def telemetry_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    require_admin(authenticate(request, state.keys))
    ws = web.WebSocketResponse(heartbeat=30.0)
    await ws.prepare(request)
    sub = state.feed.subscribe()
    state.open_responses.add(ws)
    sender = asyncio.create_task(_send_frames(ws, state, sub))
    try:
        async for _ in ws:  # the client only listens; reading handles its close and pings
            pass
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        state.feed.unsubscribe(sub)
        state.open_responses.discard(ws)
    return ws


async def _send_frames(ws: web.WebSocketResponse, state, sub) -> None:
    try:
        await ws.send_str(_hello(state).decode())
        if state.metrics is not None:
            await ws.send_str(orjson.dumps(state.snapshots.build()).decode())
        while not ws.closed:
            data = await sub.queue.get()
            await ws.send_str(data.decode())
            if sub.dropped and sub.queue.empty():
                await ws.close(code=1013, message=b"too slow: dropped from the feed")
    except ConnectionError:
        pass


def _hello(state) -> bytes:
    return orjson.dumps({"type": "hello", "model": state.model_name,
                         "workers": len(state.workers), "started_at": state.started_at,
                         "prices": state.accounting.prices.as_dict()})
