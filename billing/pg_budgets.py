"""Budgets and the ledger in PostgreSQL, shared by every gateway given the same --state-url.

Each reservation and each settlement is one atomic statement (billing/pg_sql.py), so
gateways never coordinate among themselves and can never together overspend. Reservations are
keyed by the request id, which is also the ledger row's id: settling twice is settling once.

When PostgreSQL cannot be reached:
- `reserve` raises StoreUnavailable (the request is refused with 503), and a reservation whose
  answer was lost is given back in the background, in case it had committed;
- `settle` keeps the settlement in a local outbox (billing/settlement_outbox.py) and
  resolves its future, so the client gets its bill; a background task replays the outbox
  until PostgreSQL takes it, and a gateway started later on the same outbox replays it too;
- until then the reservation stays reserved, in PostgreSQL and in `total_reserved`.
A breaker (billing/stores.py) makes refusals instant during an outage; the replay
task keeps probing, so service resumes by itself when PostgreSQL answers again.

The pool starts with no connection, so a gateway starts (and refuses budgets) while the
database is down; the schema is created on the first connection that works.
"""
from __future__ import annotations

import asyncio
import logging
import operator
from decimal import Decimal

import asyncpg

from billing.budget import BudgetExceeded, Reservation, period_start
from billing.keys import Tenant
from billing.ledger import TOTALS_NAMES, LedgerRow
from billing.pg_ledger import PgLedger
from billing.pg_sql import (
    COMMITTED,
    ENSURE_PERIOD,
    LEDGER_COLUMNS,
    REAP,
    RELEASE,
    RESERVE,
    SCHEMA,
    SCHEMA_LOCK,
    SETTLE,
    SPENT_SINCE,
    totals_query,
)
from billing.settlement_outbox import Settlement, SettlementOutbox
from billing.stores import Breaker, StoreUnavailable

log = logging.getLogger(__name__)

POOL_SIZE = 10  # per gateway: a statement holds a connection for about a millisecond
CONNECT_TIMEOUT = 2.0  # seconds; a refused connection fails at once, a lost host after this
STATEMENT_TIMEOUT = 5.0  # seconds, enforced by the server and by the client
RESERVE_ATTEMPTS = 4  # a refusal is re-checked: the period row may be new, or have changed
RESERVATION_TTL = 3600.0  # a reservation not settled by then belonged to a dead gateway
REAP_INTERVAL = 60.0
RETRY_MIN, RETRY_MAX = 0.2, 5.0  # seconds between replays of the outbox while it fails
CLOSE_TIMEOUT = 15.0

# the failures that mean "not reachable now", as opposed to a statement that is wrong; a
# connection the server dropped while idle can surface as InternalClientError ("another
# operation is in progress") on its next use
UNREACHABLE = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.InternalClientError,
               asyncpg.PostgresConnectionError, asyncpg.exceptions.OperatorInterventionError,
               asyncpg.exceptions.InsufficientResourcesError)

_row_values = operator.attrgetter(*LEDGER_COLUMNS)


def money(dollars: float) -> Decimal:
    """The float's shortest spelling as a NUMERIC: 0.1 stays 0.1, not 0.1000000000000000055."""
    return Decimal(repr(float(dollars)))


class PgBudgets:
    def __init__(self, url: str, outbox_path: str, reservation_ttl: float = RESERVATION_TTL):
        self.url = url
        self.reservation_ttl = reservation_ttl
        self.outbox = SettlementOutbox(outbox_path)
        self.breaker = Breaker("PostgreSQL")
        self.ledger = PgLedger(self)
        self.pool: asyncpg.Pool | None = None
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        self._held: dict[str, float] = {}  # request id -> reserved here, not settled in PG yet
        self._pending: dict[str, Settlement] = {}  # in the outbox, waiting for PG
        self._first_tries: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.pool = await asyncpg.create_pool(
            self.url, min_size=0, max_size=POOL_SIZE, timeout=CONNECT_TIMEOUT,
            command_timeout=STATEMENT_TIMEOUT, max_inactive_connection_lifetime=60,
            server_settings={"application_name": "inferstack-gateway",
                             "statement_timeout": str(int(STATEMENT_TIMEOUT * 1000))})
        for s in await asyncio.to_thread(self.outbox.load):  # left by an earlier run
            self._pending[s.request_id] = s
        if self._pending:
            log.warning("%d settlements from an earlier run wait for PostgreSQL",
                        len(self._pending))
            self._wake.set()
        self.ledger.loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._replay_loop(), name="pg-outbox"),
                       asyncio.create_task(self._reap_loop(), name="pg-reaper")]

    # ---- one statement, or StoreUnavailable ---------------------------------------------
    async def _call(self, work, probe: bool = False):
        """Run `work(connection)`; `probe` skips the breaker (background retries)."""
        if not probe:
            self.breaker.check()
        if self.pool is None:
            raise StoreUnavailable("PostgreSQL", "the store has not been started")
        try:
            async with self.pool.acquire() as conn:
                try:
                    if not self._schema_ready:
                        await self._create_schema(conn)
                    result = await work(conn)
                except UNREACHABLE:
                    conn.terminate()  # never handed out again: the pool makes a new one
                    raise
        except UNREACHABLE as exc:
            raise self.breaker.failed(exc) from exc
        self.breaker.succeeded()
        return result

    async def _create_schema(self, conn) -> None:
        async with self._schema_lock:
            if self._schema_ready:
                return
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                await conn.execute(SCHEMA)
            self._schema_ready = True

    # ---- reserve ------------------------------------------------------------------------
    async def reserve(self, tenant: Tenant, amount: float, request_id: str) -> Reservation:
        start = period_start(tenant.budget_period)
        period = start.isoformat()
        cost, budget = money(amount), money(tenant.budget_usd)
        args = (tenant.name, period, cost, budget, request_id, self.reservation_ttl)

        async def work(conn):
            """None once reserved, else what the tenant has committed (over budget)."""
            committed = None
            for _ in range(RESERVE_ATTEMPTS):
                if await conn.fetchval(RESERVE, *args) is not None:
                    return None
                committed = await conn.fetchval(COMMITTED, tenant.name, period)
                if committed is None:  # the period's first reservation: make its row first
                    await conn.execute(ENSURE_PERIOD, tenant.name, period, start.timestamp())
                elif budget > 0 and committed + cost > budget:
                    return committed
                # else the row appeared, or others settled, between the two statements
            return committed or Decimal(0)

        self.breaker.check()  # refused before anything was sent: nothing to give back
        try:
            committed = await self._call(work)
        except StoreUnavailable:
            # the statement may have committed before its answer was lost: give it back
            self._begin(Settlement(request_id, tenant.name, period, None), None)
            raise
        if committed is not None:
            raise BudgetExceeded(tenant.name, tenant.budget_usd, float(committed), amount)
        self._held[request_id] = amount
        return Reservation(tenant.name, period, amount, request_id=request_id)

    # ---- settle and release -------------------------------------------------------------
    def settle(self, reservation: Reservation, row: LedgerRow) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._begin(Settlement(reservation.request_id, reservation.tenant, reservation.period,
                               row), future)
        return future

    def release(self, reservation: Reservation) -> None:
        self._begin(Settlement(reservation.request_id, reservation.tenant, reservation.period,
                               None), None)

    def total_reserved(self) -> float:
        return sum(self._held.values())

    def _begin(self, s: Settlement, future: asyncio.Future | None) -> None:
        task = asyncio.create_task(self._first_try(s, future))
        self._first_tries.add(task)
        task.add_done_callback(self._first_tries.discard)

    async def _first_try(self, s: Settlement, future: asyncio.Future | None) -> None:
        try:
            await self._apply(s)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the outbox keeps it
            if not isinstance(exc, StoreUnavailable):
                log.error("settling %s failed; kept for a retry: %r", s.request_id, exc)
            try:
                await asyncio.to_thread(self.outbox.add, s)
            except Exception as disk:  # noqa: BLE001 - still retried while this process runs
                log.error("settlement %s kept in memory only: %r", s.request_id, disk)
                self._keep(s)
                _resolve(future, disk)
                return
            self._keep(s)
        _resolve(future, None)

    def _keep(self, s: Settlement) -> None:
        self._pending[s.request_id] = s
        self._wake.set()

    async def _apply(self, s: Settlement, probe: bool = False) -> None:
        async def work(conn):
            if s.row is None:
                await conn.execute(RELEASE, s.request_id)
            else:
                await conn.execute(SETTLE, s.request_id, s.tenant, s.period, *_row_values(s.row))

        await self._call(work, probe)
        self._held.pop(s.request_id, None)

    # ---- background: the outbox and expired reservations --------------------------------
    async def _replay_loop(self) -> None:
        delay = RETRY_MIN
        while True:
            await self._wake.wait()
            self._wake.clear()
            if await self._replay_once():
                delay = RETRY_MIN
                continue
            self._wake.set()  # still pending: try again after the back-off
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX, delay * 2)

    async def _replay_once(self) -> bool:
        """Replay every pending settlement, oldest first; True when none is left failing."""
        for s in list(self._pending.values()):
            try:
                await self._apply(s, probe=True)
            except StoreUnavailable:
                return False
            except Exception as exc:  # noqa: BLE001 - kept; the others may still go through
                log.error("replaying settlement %s failed: %r", s.request_id, exc)
                continue
            self._pending.pop(s.request_id, None)
            try:
                await asyncio.to_thread(self.outbox.remove, s.request_id)
            except Exception as exc:  # noqa: BLE001 - replaying it again changes nothing
                log.warning("could not drop settlement %s from the outbox: %r",
                            s.request_id, exc)
        return not self._pending

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            await self.reap()

    async def reap(self) -> None:
        """Give back reservations past their time (their gateway died before settling)."""
        try:
            await self._call(lambda conn: conn.execute(REAP), probe=True)
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            log.info("reaping expired reservations failed: %r", exc)

    # ---- reads --------------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait until every settlement begun so far has reached PostgreSQL or the outbox."""
        if self._first_tries:
            await asyncio.wait(set(self._first_tries))

    @property
    def pending(self) -> int:
        """Settlements waiting in the outbox for PostgreSQL."""
        return len(self._pending)

    async def spent_since(self, tenant: str, since: float) -> float:
        return float(await self._call(lambda conn: conn.fetchval(SPENT_SINCE, tenant, since)))

    async def totals(self, period: str = "day", since: float | None = None,
                     until: float | None = None, tenant: str | None = None) -> list[dict]:
        sql, args = totals_query(period, since, until, tenant)
        names = TOTALS_NAMES
        rows = await self._call(lambda conn: conn.fetch(sql, *args))
        return [dict(zip(names, tuple(r))) for r in rows]

    async def close(self) -> None:
        if self._first_tries:
            await asyncio.wait(set(self._first_tries), timeout=CLOSE_TIMEOUT)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pending:
            try:
                await asyncio.wait_for(self._replay_once(), CLOSE_TIMEOUT)
            except (TimeoutError, StoreUnavailable):
                pass
        if self._pending:
            log.warning("%d settlements stay in %s until a gateway replays them",
                        len(self._pending), self.outbox.path)
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), CLOSE_TIMEOUT)
            except TimeoutError:
                self.pool.terminate()


def _resolve(future: asyncio.Future | None, error: Exception | None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(True)
    else:
        future.set_exception(error)
        future.exception()  # marked retrieved: an answer that no longer waits must not warn
