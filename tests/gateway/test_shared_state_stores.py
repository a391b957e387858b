"""The shared stores against real servers, below HTTP: PostgreSQL's atomic reservations and
idempotent settlements (several pools at once, retries, expiry, the outbox across an outage
and a restart, totals equal to the SQLite ledger's) and Redis's buckets and fair-share clock
(several clients at once, an outage and a Redis that forgot its scripts)."""
from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from types import SimpleNamespace

import asyncpg
import pytest

from billing.budget import BudgetExceeded, Reservation, period_start
from billing.keys import ApiKey, Tenant
from billing.ledger import Ledger, LedgerRow
from billing.pg_budgets import PgBudgets
from billing.pricing import PriceBook
from billing.redis_limits import RedisLimits
from billing.settlement_outbox import Settlement
from billing.stores import StoreUnavailable
from contract.sampling_params import SamplingParams
from gateway.serving.accounting import Accounting
from gateway.serving.inflight import InFlightTable
from testkit.services.postgres import postgres_server
from testkit.services.redis import redis_server

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def pg():
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="module")
def rd(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def db(pg):
    """A database of its own for each test (the schema is made by the store on first use)."""
    name = "t" + uuid.uuid4().hex[:12]

    async def create():
        conn = await asyncpg.connect(pg.url)
        try:
            await conn.execute(f"CREATE DATABASE {name}")
        finally:
            await conn.close()
    asyncio.run(create())
    return pg.url.rsplit("/", 1)[0] + "/" + name


def row(request_id: str, tenant: str, cost: float, created: float | None = None,
        output_tokens: int = 10) -> LedgerRow:
    created = time.time() if created is None else created
    return LedgerRow(request_id, tenant, "key", "m", created, created + 1.5, 0, 3, 4,
                     output_tokens, cost / 4, cost / 4, cost / 2, cost, 1.0, 0.01, 0.1, 1.5,
                     "length", "ok")


async def account(url: str, tenant: str) -> tuple[Decimal, Decimal, int, int]:
    """(spent, reserved, reservations held, ledger rows) of a tenant, as PostgreSQL has them."""
    conn = await asyncpg.connect(url)
    try:
        spent, reserved = await conn.fetchrow(
            "SELECT COALESCE(SUM(spent), 0), COALESCE(SUM(reserved), 0) FROM budget_periods "
            "WHERE tenant = $1", tenant)
        held = await conn.fetchval("SELECT COUNT(*) FROM reservations WHERE tenant = $1", tenant)
        rows = await conn.fetchval("SELECT COUNT(*) FROM requests WHERE tenant = $1", tenant)
        return spent, reserved, held, rows
    finally:
        await conn.close()


async def open_stores(url, tmp_path, n: int, **kw) -> list[PgBudgets]:
    stores = [PgBudgets(url, str(tmp_path / f"outbox-{i}.sqlite3"), **kw) for i in range(n)]
    for s in stores:
        await s.start()
    return stores


# ---- PostgreSQL ----------------------------------------------------------------------------
def test_concurrent_reservations_from_several_pools_never_exceed_the_budget(db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)

    async def main():
        stores = await open_stores(db, tmp_path, 4)  # four gateways, ten connections each
        attempts = [stores[i % 4].reserve(tenant, 0.03, f"r{i}") for i in range(200)]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        held = await account(db, "t")
        taken = [r for r in results if not isinstance(r, BaseException)]
        for r, i in zip(taken, range(len(taken))):
            stores[i % 4].settle(r, row(r.request_id, "t", 0.01))
        for s in stores:
            await s.drain()
        settled = await account(db, "t")
        for s in stores:
            await s.close()
        return results, taken, held, settled

    results, taken, held, settled = asyncio.run(main())
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert len(taken) == 33 and len(refused) == 167  # 33 * 0.03 = 0.99; a 34th passes $1
    assert held == (Decimal("0"), Decimal("0.99"), 33, 0)
    assert settled == (Decimal("33") * Decimal(repr(0.01)), Decimal("0"), 0, 33)


def test_a_new_period_made_by_concurrent_first_reservations_refuses_none(db, tmp_path):
    unlimited, roomy = Tenant("u"), Tenant("r", budget_usd=100.0)

    async def main():
        stores = await open_stores(db, tmp_path, 4)
        results = await asyncio.gather(*(stores[i % 4].reserve((unlimited, roomy)[i % 2], 0.5,
                                                               f"n{i}") for i in range(100)))
        for s in stores:
            await s.close()
        return results, await account(db, "u"), await account(db, "r")

    results, u, r = asyncio.run(main())
    assert len(results) == 100  # none raised BudgetExceeded while its period row was made
    assert u == (0, 25, 50, 0) and r == (0, 25, 50, 0)


def test_a_settlement_retried_twice_writes_one_row(db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)
    outbox = str(tmp_path / "outbox.sqlite3")

    async def main():
        store = PgBudgets(db, outbox)
        await store.start()
        reservation = await store.reserve(tenant, 0.5, "req-1")
        bill = row("req-1", "t", 0.2)
        await store.settle(reservation, bill)  # the first try, awaited as an answer does
        await store.settle(reservation, bill)  # a retry after an answer that was lost
        store.outbox.add(Settlement("req-1", "t", reservation.period, bill))  # and a replay
        await store.close()
        replayer = PgBudgets(db, outbox)
        await replayer.start()
        for _ in range(100):
            if replayer.pending == 0:
                break
            await asyncio.sleep(0.05)
        await replayer.close()
        return replayer.pending, len(replayer.outbox.load()), await account(db, "t")

    assert asyncio.run(main()) == (0, 0, (Decimal(repr(0.2)), Decimal("0"), 0, 1))


def test_an_expired_reservation_is_reaped_and_its_late_settlement_still_billed(db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)

    async def main():
        (store,) = await open_stores(db, tmp_path, 1, reservation_ttl=0.0)
        reservation = await store.reserve(tenant, 0.5, "late")
        given = await store.reserve(tenant, 0.25, "released")
        store.release(given)
        await store.drain()
        before = await account(db, "t")
        await store.reap()  # the gateway that held "late" is taken for dead
        reaped = await account(db, "t")
        await store.settle(reservation, row("late", "t", 0.125))
        after = await account(db, "t")
        await store.close()
        return before, reaped, after

    before, reaped, after = asyncio.run(main())
    assert before == (Decimal("0"), Decimal("0.5"), 1, 0)  # the release gave its 0.25 back
    assert reaped == (Decimal("0"), Decimal("0"), 0, 0)
    assert after == (Decimal("0.125"), Decimal("0"), 0, 1)  # never below zero reserved


def test_a_new_period_starts_from_what_the_ledger_already_holds(db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)

    async def main():
        (store,) = await open_stores(db, tmp_path, 1)
        # a row in the ledger with no budget period yet (a ledger from before the budgets)
        period = period_start("day").isoformat()
        await store.settle(Reservation("t", period, 0.0, request_id="old"), row("old", "t", 0.9))
        assert await account(db, "t") == (0, 0, 0, 1)
        with pytest.raises(BudgetExceeded):
            await store.reserve(tenant, 0.2, "r1")  # 0.9 spent + 0.2 > 1
        assert await store.reserve(tenant, 0.1, "r2")
        await store.close()

    asyncio.run(main())


def test_totals_and_spending_equal_the_sqlite_ledgers(db, tmp_path):
    tenants = [Tenant("a"), Tenant("b")]
    base = 1_767_225_600.0  # 2026-01-01 00:00 UTC
    rows = [row(f"q{i}", tenants[i % 2].name, 0.001 * (i + 1),
                created=base + i * 5400.0 + (i % 3) * 86400 * 31, output_tokens=i)
            for i in range(24)]  # hours, days and months apart

    async def main():
        (store,) = await open_stores(db, tmp_path, 1)
        for i, r in enumerate(rows):
            reservation = await store.reserve(tenants[i % 2], 0.1, r.id)
            await store.settle(reservation, r)
        ours = {p: await store.totals(p) for p in ("hour", "day", "month", "all")}
        ours["bounded"] = await store.totals("day", base + 86400, base + 86400 * 40, "a")
        spent = await store.spent_since("a", base + 3600)
        await store.close()
        return ours, spent

    ours, spent = asyncio.run(main())
    sqlite = Ledger(str(tmp_path / "ledger.sqlite3"))
    for r in rows:
        sqlite.record(r)
    sqlite.flush()
    theirs = {p: sqlite.totals(p) for p in ("hour", "day", "month", "all")}
    theirs["bounded"] = sqlite.totals("day", base + 86400, base + 86400 * 40, "a")
    assert spent == pytest.approx(sqlite.spent_since("a", base + 3600), rel=1e-12)
    sqlite.close()
    for name, expected in theirs.items():
        assert len(ours[name]) == len(expected) > 1, name
        for got, want in zip(ours[name], expected):
            assert got.keys() == want.keys()
            for k, v in want.items():  # float sums may differ in their last bits
                assert got[k] == (v if isinstance(v, str) else pytest.approx(v, rel=1e-12))


def test_settlements_wait_out_an_outage_and_survive_a_restart(pg, db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)
    outbox = str(tmp_path / "outbox.sqlite3")

    async def main():
        store = PgBudgets(db, outbox)
        await store.start()
        kept = await store.reserve(tenant, 0.5, "kept")  # settled by this gateway, later
        lost = await store.reserve(tenant, 0.25, "lost")  # this gateway stops before PG returns
        pg.kill()
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.reserve(tenant, 0.01, "refused")
        with pytest.raises(StoreUnavailable):
            await store.reserve(tenant, 0.01, "refused-fast")  # the breaker: no connect
        refused_in = time.monotonic() - began
        await asyncio.wait_for(store.settle(kept, row("kept", "t", 0.125)), 10)
        await asyncio.wait_for(store.settle(lost, row("lost", "t", 0.0625)), 10)
        await store.drain()
        spooled = (store.pending, store.total_reserved(), len(store.outbox.load()))
        pg.start()
        for _ in range(200):  # the replay's back-off is at most 5 s
            if store.pending == 0:
                break
            await asyncio.sleep(0.05)
        resumed = await store.reserve(tenant, 0.01, "after")  # no restart needed
        await store.close()
        return refused_in, spooled, store.pending, resumed

    try:
        refused_in, spooled, left, resumed = asyncio.run(main())
    finally:
        if not pg.ready():
            pg.start()
    assert refused_in < 5  # refused, not hung
    assert spooled == (2 + 1, 0.75, 3)  # both bills and the refused reservation's give-back
    assert left == 0 and resumed.amount == 0.01
    assert asyncio.run(account(db, "t")) == (Decimal("0.1875"), Decimal("0.01"), 1, 2)


def test_an_outbox_left_by_a_stopped_gateway_is_replayed_by_the_next(pg, db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)
    outbox = str(tmp_path / "outbox.sqlite3")

    async def first():
        store = PgBudgets(db, outbox)
        await store.start()
        reservation = await store.reserve(tenant, 0.5, "r")
        pg.kill()
        await store.settle(reservation, row("r", "t", 0.25))
        await store.close()  # PostgreSQL still down: the settlement stays on disk

    async def second():
        store = PgBudgets(db, outbox)
        await store.start()  # PostgreSQL is still down: a gateway starts all the same
        waiting = store.pending
        pg.start()
        for _ in range(200):
            if store.pending == 0:
                break
            await asyncio.sleep(0.05)
        await store.close()
        return waiting, store.pending

    try:
        asyncio.run(first())
        waiting, left = asyncio.run(second())
    finally:
        if not pg.ready():
            pg.start()
    assert (waiting, left) == (1, 0)
    assert asyncio.run(account(db, "t")) == (Decimal("0.25"), Decimal("0"), 0, 1)


# ---- Redis ---------------------------------------------------------------------------------
def test_request_buckets_hold_across_several_clients(rd):
    tenant = Tenant("rpm-" + uuid.uuid4().hex[:8], requests_per_minute=10)

    async def main():
        clients = [RedisLimits(rd.url) for _ in range(4)]
        began = time.monotonic()
        waits = await asyncio.gather(*(clients[i % 4].take_request(tenant) for i in range(50)))
        elapsed = time.monotonic() - began
        for c in clients:
            await c.close()
        return waits, elapsed

    waits, elapsed = asyncio.run(main())
    taken = sum(w == 0 for w in waits)
    assert 10 <= taken <= 10 + int(elapsed * 10 / 60)
    assert all(0 < w <= 6 for w in waits if w)  # one request refills in 6 s


def test_token_buckets_refund_and_refuse_what_never_fits(rd):
    tenant = Tenant("tpm-" + uuid.uuid4().hex[:8], tokens_per_minute=600)

    async def main():
        limits = RedisLimits(rd.url)
        first = await limits.take_tokens(tenant, 500)  # 100 left
        short = await limits.take_tokens(tenant, 200)  # 100 more needed: 10 s at 10 per s
        limits.refund(tenant, 200)
        await asyncio.wait(limits._background)
        after_refund = await limits.take_tokens(tenant, 300)
        never = await limits.take_tokens(tenant, 601)
        unlimited = await limits.take_tokens(Tenant("free"), 10**9)
        await limits.close()
        return first, short, after_refund, never, unlimited

    first, short, after_refund, never, unlimited = asyncio.run(main())
    assert first == 0 and short == pytest.approx(10, abs=0.1)
    assert after_refund == 0 and never == float("inf") and unlimited == 0


def test_the_fair_share_clock_is_shared_and_follows_weights(rd):
    a = Tenant("fa-" + uuid.uuid4().hex[:8], weight=1.0)
    b = Tenant("fb-" + uuid.uuid4().hex[:8], weight=3.0)

    async def main():
        gateways = RedisLimits(rd.url, 100), RedisLimits(rd.url, 100)
        # each tenant's requests alternate between the two gateways
        starts = [(await gateways[i % 2].start_time(a, 10), "a") for i in range(4)]
        starts += [(await gateways[i % 2].start_time(b, 10), "b") for i in range(12)]
        gateways[1].correct(a, 10, 0)  # a request of a's served nothing: 0.1 s back
        await asyncio.wait(gateways[1]._background)
        corrected = await gateways[0].start_time(a, 10)
        for g in gateways:
            await g.close()
        return starts, corrected

    starts, corrected = asyncio.run(main())
    a_starts = [t for t, n in starts if n == "a"]
    # one clock for both gateways: 10 tokens at weight 1 and 100 tokens/s advance it 0.1 s
    assert [round(y - x, 2) for x, y in zip(a_starts, a_starts[1:])] == [0.1, 0.1, 0.1]
    assert corrected - a_starts[-1] == pytest.approx(0.0, abs=0.01)
    assert [n for _, n in sorted(starts)[:8]].count("b") == 6  # weight 3 against 1


def test_redis_down_refuses_and_a_fresh_redis_serves_again(rd):
    tenant = Tenant("down-" + uuid.uuid4().hex[:8], requests_per_minute=100)

    async def main():
        limits = RedisLimits(rd.url)
        assert await limits.take_request(tenant) == 0  # the script is loaded now
        rd.kill()
        began = time.monotonic()
        refused = 0
        for _ in range(20):
            try:
                await limits.take_request(tenant)
            except StoreUnavailable:
                refused += 1
        refused_in = time.monotonic() - began
        rd.start()  # empty: it has forgotten the scripts (NOSCRIPT) and the buckets
        for _ in range(100):
            try:
                resumed = await limits.take_request(tenant)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.05)
        await limits.close()
        return refused, refused_in, resumed

    try:
        refused, refused_in, resumed = asyncio.run(main())
    finally:
        if not rd.ping():
            rd.start()
    assert refused == 20 and refused_in < 5 and resumed == 0


# ---- both, under the accounting ------------------------------------------------------------
def test_a_client_that_leaves_during_admission_leaves_nothing_held(db, rd, tmp_path):
    tenant = Tenant("leaver-" + uuid.uuid4().hex[:8], tokens_per_minute=600, budget_usd=1.0)
    key = ApiKey("00" * 32, tenant, "k")

    async def main():
        limits = RedisLimits(rd.url)
        accounting = Accounting(InFlightTable(), PriceBook.preset("seed"),
                                PgBudgets(db, str(tmp_path / "outbox.sqlite3")), limits)
        await accounting.start()
        gens = [SimpleNamespace(params=SamplingParams(max_tokens=100), prompt=[1, 2, 3], n=1,
                                request_id=f"c{i}", charge=None) for i in range(5)]
        admissions = [asyncio.create_task(accounting.admit(g, key)) for g in gens]
        await asyncio.sleep(0)  # each waits on its charge: 103 tokens, a reservation, a start
        for a in admissions:
            a.cancel()
        outcomes = await asyncio.gather(*admissions, return_exceptions=True)
        charges = [t for t in asyncio.all_tasks()
                   if t.get_coro().__qualname__ == "Accounting._charge"]
        await asyncio.wait(charges)  # they run on after their clients left...
        await accounting.budgets.drain()  # ...and are given back
        if limits._background:
            await asyncio.wait(limits._background)
        periods = await _periods(db, tenant.name)
        full = await limits.take_tokens(tenant, 600)  # 515 were charged: all came back
        await accounting.close()
        return outcomes, gens, charges, periods, await account(db, tenant.name), full

    outcomes, gens, charges, periods, held, full = asyncio.run(main())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert all(g.charge is None for g in gens)
    assert len(charges) == 5 and all(c.exception() is None for c in charges)
    assert periods == 1  # the reservations were made (the period row is theirs)...
    assert held == (0, 0, 0, 0)  # ...and given back, with the tokens
    assert full == 0


async def _periods(url: str, tenant: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval("SELECT COUNT(*) FROM budget_periods WHERE tenant = $1",
                                   tenant)
    finally:
        await conn.close()
