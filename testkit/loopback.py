"""One aiohttp handler served on loopback for the length of one client exchange.

A plain `AppRunner`, as in production: aiohttp's TestServer cancels the handler when the
client leaves, which hides exactly what the stream code must cope with."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web


async def serve_once(method: str, handler, client_does: Callable[[aiohttp.ClientSession, str],
                                                                 Awaitable[Any]]) -> Any:
    """Serve `handler` at `method /` and return what `client_does(session, url)` returns."""
    app = web.Application()
    app.router.add_route(method, "/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            return await client_does(session, f"http://{host}:{port}/")
    finally:
        await runner.cleanup()
