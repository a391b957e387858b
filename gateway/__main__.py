"""`python -m gateway`: serve the OpenAI-compatible API (see --help)."""
from __future__ import annotations

import asyncio
import logging
import sys

import uvloop
from aiohttp import web

from gateway.app import create_app
from gateway.config import load_config


async def serve(config) -> None:
    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    logging.getLogger("gateway").info("listening on http://%s:%d", config.host, config.port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    config = load_config(argv)
    try:
        uvloop.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
