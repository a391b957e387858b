"""The fleet in Redis: every gateway given --redis-url registers itself and reads the others.

Each gateway writes one key, `inferstack:fleet:gateway:<id>`, holding its id, address, pid,
queue and workers with their load, every `interval` seconds with a TTL of `ttl` seconds: a
gateway that stops cleanly deletes its key, one that dies disappears when the key expires.
`read` lists every live gateway. Fleet-wide revenue and cache-hit rate come from the ledger
(`fleet_totals`): with --state-url that is the shared PostgreSQL ledger, so the sum is every
gateway's, otherwise only this gateway's own.

Redis unreachable: a beat fails quietly (counted in `errors`) and the next one tries again;
the fleet view keeps its last reading, marked stale by its `read_at`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aioredis

from gateway.serving.worker_pool import WorkerPool

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.serving.queue import RequestQueue
    from gateway.workers.handle import WorkerHandle

log = logging.getLogger(__name__)
KEY_PREFIX = "inferstack:fleet:gateway:"
TTL_SECONDS = 5.0
INTERVAL_SECONDS = 1.0
TOTALS_EVERY_SECONDS = 5.0  # the ledger is summed less often than gateways beat


def gateway_id(config) -> str:
    """Unique per process: the configured one, else host name, port and pid."""
    return getattr(config, "gateway_id", None) or \
        f"{socket.gethostname()}:{config.port}:{os.getpid()}"


def address(config: GatewayConfig) -> str:
    host = getattr(config, "advertise_host", None) or config.host
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{config.port}"


class GatewayView(Protocol):
    """What a gateway's fleet entry reads of it (its state)."""

    config: GatewayConfig
    started_at: float
    draining: bool
    queue: RequestQueue
    workers: list[WorkerHandle]


def describe_gateway(state: GatewayView, pool: WorkerPool, ident: str) -> dict:
    return {"id": ident, "address": address(state.config), "pid": os.getpid(),
            "started_at": state.started_at, "heartbeat": time.time(),
            "draining": state.draining, "queue": len(state.queue),
            "running": sum(w.num_inflight for w in state.workers),
            "workers": pool.describe_all()}


class FleetRegistry:
    def __init__(self, url: str, ident: str, describe: Callable[[], dict],
                 ttl: float = TTL_SECONDS, interval: float = INTERVAL_SECONDS):
        self.ident, self.describe = ident, describe
        self.ttl, self.interval = ttl, interval
        self.client = aioredis.Redis.from_url(url, socket_timeout=1.0,
                                              socket_connect_timeout=1.0)
        self.gateways: list[dict] = []  # the latest reading of the fleet
        self.read_at: float | None = None
        self.totals: dict | None = None  # set by the app's loop from the ledger
        self.errors = 0

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.ident

    async def beat(self) -> None:
        await self.client.set(self.key, json.dumps(self.describe()),
                              px=max(1, int(self.ttl * 1000)))

    async def read(self) -> list[dict]:
        """Every live gateway, by id."""
        keys = [k async for k in self.client.scan_iter(match=KEY_PREFIX + "*", count=500)]
        values = await self.client.mget(keys) if keys else []
        found = []
        for value in values:
            if value is None:  # expired between the scan and the read
                continue
            try:
                found.append(json.loads(value))
            except ValueError:
                self.errors += 1
        found.sort(key=lambda g: str(g.get("id")))
        self.gateways, self.read_at = found, time.time()
        return found

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.beat()
                await self.read()
            except Exception as exc:  # noqa: BLE001 - Redis down: beat again next time
                self.errors += 1
                log.debug("fleet registry: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass

    def view(self) -> dict:
        """What the live feed carries: the latest reading, no round trip."""
        return {"gateways": self.gateways, "read_at": self.read_at, "self": self.ident,
                "totals": self.totals}

    async def close(self) -> None:
        try:
            await self.client.delete(self.key)  # gone at once, not after the TTL
        except Exception as exc:  # noqa: BLE001 - it expires by itself
            log.debug("fleet registry: could not deregister: %r", exc)
        await self.client.aclose()


async def fleet_totals(ledger) -> dict:
    """Revenue, tokens and cache-hit rate over the whole ledger (every gateway's with a
    shared one). The readers block, so they run on a worker thread."""
    await asyncio.to_thread(ledger.flush)
    rows = await asyncio.to_thread(ledger.totals, "all")
    sums = {k: sum(float(r.get(k) or 0) for r in rows) for k in (
        "requests", "cache_hit_tokens", "cache_miss_tokens", "output_tokens",
        "cost_cache_hit", "cost_cache_miss", "cost_output", "cost_total")}
    prompt = sums["cache_hit_tokens"] + sums["cache_miss_tokens"]
    sums["requests"] = int(sums["requests"])
    return {**sums, "cache_hit_rate": sums["cache_hit_tokens"] / prompt if prompt else 0.0}
