"""The batch tier's money in PostgreSQL (a real server): a batch line run again by another
gateway under the same request id is billed once (its new reservation given back, `spent`
and the row as the first run left them), rows carry tier and batch id, totals split by tier,
and a table made before tiers gains the columns."""
from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal

import asyncpg
import pytest

from billing.keys import Tenant
from billing.ledger import LedgerRow
from billing.pg_budgets import PgBudgets
from testkit.services.postgres import postgres_server

pytestmark = [pytest.mark.postgres]


@pytest.fixture(scope="module")
def pg():
    with postgres_server() as server:
        yield server


@pytest.fixture
def db(pg):
    name = "t" + uuid.uuid4().hex[:12]

    async def create():
        conn = await asyncpg.connect(pg.url)
        try:
            await conn.execute(f"CREATE DATABASE {name}")
        finally:
            await conn.close()
    asyncio.run(create())
    return pg.url.rsplit("/", 1)[0] + "/" + name


def row(request_id: str, cost: float, tier: str = "online",
        batch_id: str | None = None) -> LedgerRow:
    now = time.time()
    return LedgerRow(request_id, "t", "k", "m", now, now + 1, 0, 1, 2, 3, cost / 4, cost / 4,
                     cost / 2, cost, 0.5 if tier == "batch" else 1.0, 0.1, 0.2, 1.0, "stop",
                     "ok", "chat", tier, batch_id)


async def fetch(url: str, sql: str):
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


def test_a_batch_line_run_again_by_another_gateway_is_billed_once(db, tmp_path):
    tenant = Tenant("t", budget_usd=1.0)

    async def main():
        first = PgBudgets(db, str(tmp_path / "a.sqlite3"))
        await first.start()
        reservation = await first.reserve(tenant, 0.5, "batch_1-line-3")
        await first.settle(reservation, row("batch_1-line-3", 0.3, "batch", "batch_1"))
        await first.close()  # it died before the batch recorded the line's result
        second = PgBudgets(db, str(tmp_path / "b.sqlite3"))
        await second.start()
        reservation = await second.reserve(tenant, 0.5, "batch_1-line-3")
        await second.settle(reservation, row("batch_1-line-3", 0.35, "batch", "batch_1"))
        online = await second.reserve(tenant, 0.1, "chatcmpl-1")
        await second.settle(online, row("chatcmpl-1", 0.1))
        totals = await second.totals("all")
        await second.close()
        return totals

    totals = asyncio.run(main())
    periods = asyncio.run(fetch(db, "SELECT spent, reserved FROM budget_periods"))
    assert [tuple(p) for p in periods] == [(Decimal(repr(0.3)) + Decimal(repr(0.1)), 0)]
    rows = asyncio.run(fetch(db, "SELECT id, cost_total, tier, batch_id FROM requests "
                                 "ORDER BY id"))
    assert [tuple(r) for r in rows] == [("batch_1-line-3", 0.3, "batch", "batch_1"),
                                        ("chatcmpl-1", 0.1, "online", None)]
    assert asyncio.run(fetch(db, "SELECT * FROM reservations")) == []
    (total,) = totals
    assert (total["requests"], total["batch_requests"]) == (2, 1)
    assert total["cost_batch"] == pytest.approx(0.3)
    assert total["cost_total"] == pytest.approx(0.4)


def test_a_requests_table_made_before_tiers_gains_the_columns(db, tmp_path):
    async def main():
        conn = await asyncpg.connect(db)
        try:  # the table as the schema before tiers made it, with one row
            await conn.execute(
                "CREATE TABLE requests (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_name "
                "TEXT, model TEXT, created DOUBLE PRECISION NOT NULL, finished DOUBLE "
                "PRECISION NOT NULL, priority INTEGER, cache_hit_tokens BIGINT NOT NULL, "
                "cache_miss_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL, "
                "cost_cache_hit DOUBLE PRECISION NOT NULL, cost_cache_miss DOUBLE PRECISION "
                "NOT NULL, cost_output DOUBLE PRECISION NOT NULL, cost_total DOUBLE "
                "PRECISION NOT NULL, price_multiplier DOUBLE PRECISION NOT NULL, "
                "queue_seconds DOUBLE PRECISION, ttft_seconds DOUBLE PRECISION, e2e_seconds "
                "DOUBLE PRECISION, finish_reason TEXT, status TEXT NOT NULL, kind TEXT)")
            await conn.execute("INSERT INTO requests VALUES ('old', 't', 'k', 'm', 1, 2, 0, "
                               "1, 2, 3, 0.1, 0.1, 0.2, 0.4, 1, 0, 0, 0, 'stop', 'ok', 'chat')")
        finally:
            await conn.close()
        store = PgBudgets(db, str(tmp_path / "outbox.sqlite3"))
        await store.start()
        reservation = await store.reserve(Tenant("t"), 0.5, "new")
        await store.settle(reservation, row("new", 0.2, "batch", "batch_9"))
        await store.close()

    asyncio.run(main())
    rows = asyncio.run(fetch(db, "SELECT id, tier, batch_id FROM requests ORDER BY id"))
    assert [tuple(r) for r in rows] == [("new", "batch", "batch_9"), ("old", "online", None)]
