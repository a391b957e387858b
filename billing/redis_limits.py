"""Per-tenant rate limits and the fair-share clock in Redis, shared by every gateway given the
same --redis-url: a tenant's requests per minute and tokens per minute hold across the fleet,
and a tenant bursting on one gateway pushes back its own later requests on all of them.

Each check is one Lua script (billing/redis_scripts.py) sent as EVALSHA: atomic, one
round trip; the scripts are registered once, and loaded again by the client by itself when a
restarted Redis has forgotten them (NOSCRIPT). Unlimited tenants cost no round trip for
buckets.

Redis unreachable: every check raises StoreUnavailable (the request is refused with 503,
never admitted unmetered); refunds and clock corrections at the end of a request are best
effort in the background (a lost refund only leaves a tenant fewer tokens for a minute). A
breaker makes refusals instant during an outage and lets a probe through every second, so
service resumes by itself. Redis keeps no durable state here: a Redis that lost its data
starts every bucket full, which is what a minute of idleness would give anyway.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from billing.keys import Tenant
from billing.redis_scripts import CORRECT, REFUND, START, TAKE
from billing.stores import Breaker

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32  # per gateway; a check holds one for well under a millisecond
POOL_TIMEOUT = 1.0  # seconds to wait for a free connection before refusing
SOCKET_TIMEOUT = 1.0  # connect, and each reply
PREFIX = "inferstack"

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)


def bucket_key(tenant: str, kind: str) -> str:
    # the tenant in a hash tag: a Redis Cluster keeps one tenant's keys on one node
    return f"{PREFIX}:{{{tenant}}}:{kind}"


class RedisLimits:
    def __init__(self, url: str, tokens_per_second: float = 1000.0):
        self.url = url
        self.tokens_per_second = tokens_per_second
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=POOL_TIMEOUT,
            socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
            # once: a pooled connection that a restarted Redis closed is replaced at once
            retry=Retry(NoBackoff(), 1))
        self.client = aioredis.Redis(connection_pool=pool)
        self._take = self.client.register_script(TAKE)
        self._refund = self.client.register_script(REFUND)
        self._start = self.client.register_script(START)
        self._correct = self.client.register_script(CORRECT)
        self.breaker = Breaker("Redis")
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        pass  # connections are made on first use: a gateway starts while Redis is down

    async def _run(self, script, keys: list[str], args: list) -> str:
        self.breaker.check()
        try:
            reply = await script(keys=keys, args=args)
        except UNREACHABLE as exc:
            raise self.breaker.failed(exc) from exc
        self.breaker.succeeded()
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    async def _take_from(self, tenant: Tenant, kind: str, capacity: float,
                         amount: float) -> float:
        if capacity <= 0:
            return 0.0  # unlimited
        return float(await self._run(self._take, [bucket_key(tenant.name, kind)],
                                     [repr(float(capacity)), repr(float(amount))]))

    # ---- checks (awaited by admission) --------------------------------------------------
    async def take_request(self, tenant: Tenant) -> float:
        return await self._take_from(tenant, "requests", tenant.requests_per_minute, 1)

    async def take_tokens(self, tenant: Tenant, tokens: int) -> float:
        return await self._take_from(tenant, "tokens", tenant.tokens_per_minute, tokens)

    async def start_time(self, tenant: Tenant, tokens: int) -> float:
        seconds = tokens / (tenant.weight * self.tokens_per_second)
        ahead = float(await self._run(self._start, [bucket_key(tenant.name, "fair")],
                                      [repr(seconds)]))
        return time.monotonic() + ahead

    # ---- corrections (best effort, in the background) -----------------------------------
    def refund(self, tenant: Tenant, tokens: int) -> None:
        if tokens > 0 and tenant.tokens_per_minute > 0:
            self._spawn(self._run(self._refund, [bucket_key(tenant.name, "tokens")],
                                  [repr(float(tenant.tokens_per_minute)), repr(float(tokens))]))

    def correct(self, tenant: Tenant, estimated: int, actual: int) -> None:
        if actual != estimated:
            seconds = (actual - estimated) / (tenant.weight * self.tokens_per_second)
            self._spawn(self._run(self._correct, [bucket_key(tenant.name, "fair")],
                                  [repr(seconds)]))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a rate-limit correction was lost: %r", task.exception())

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
        await self.client.aclose()
