"""The batch tier's money in this process: the price book's batch multiplier on top of the
time-of-day windows, ledger rows marked by tier and batch id (an older ledger gains the
columns), totals split by tier, and a settlement repeated under a request id the ledger
already holds (a batch line run again after a crash) billed once, in the ledger and the
budget."""
from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import time
from types import SimpleNamespace

import pytest

from billing.budget import BudgetExceeded
from billing.embedded_stores import EmbeddedBudgets
from billing.keys import ApiKey, Tenant
from billing.ledger import Ledger, LedgerRow
from billing.pricing import PriceBook, PriceBookError
from contract.sampling_params import SamplingParams
from gateway.serving.accounting import Accounting
from gateway.serving.inflight import InFlightTable

NIGHT = dt.datetime(2026, 12, 3, 17, 0, tzinfo=dt.UTC)  # inside 16:30-00:30
NOON = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)


def book(**extra) -> PriceBook:
    return PriceBook.from_dict({"preset": "deepseek-v3", **extra,
                                "windows": [{"start": "16:30", "end": "00:30",
                                             "multiplier": 0.5}]})


def row(request_id: str, cost: float, tier: str = "online", batch_id: str | None = None,
        tenant: str = "t") -> LedgerRow:
    now = time.time()
    return LedgerRow(request_id, tenant, "k", "m", now, now + 1, 0, 1, 2, 3, cost / 4,
                     cost / 4, cost / 2, cost, 1.0, 0.1, 0.2, 1.0, "stop", "ok", "chat",
                     tier, batch_id)


class Record(SimpleNamespace):
    """A request record's stand-in, held in sets as the real one (eq=False) is."""

    __hash__ = object.__hash__  # type: ignore[assignment]


def test_the_batch_multiplier_applies_on_top_of_the_windows():
    prices = book()
    assert prices.batch_multiplier == 0.5  # the default: OpenAI's Batch API price
    assert prices.multiplier(NOON) == 1.0
    assert prices.multiplier(NOON, tier="batch") == 0.5
    assert prices.multiplier(NIGHT, tier="batch") == 0.25
    assert book(batch_multiplier=0.3).multiplier(NIGHT, tier="batch") == pytest.approx(0.15)
    assert prices.as_dict()["batch_multiplier"] == 0.5
    online = prices.cost(100, 200, 300, prices.multiplier(NOON))
    batch = prices.cost(100, 200, 300, prices.multiplier(NOON, tier="batch"))
    for part in ("cache_hit_input", "cache_miss_input", "output"):  # each kind at half
        assert getattr(batch, part) == pytest.approx(getattr(online, part) / 2, rel=1e-15)


@pytest.mark.parametrize("bad", [-0.5, "half", True])
def test_a_bad_batch_multiplier_is_refused(bad):
    with pytest.raises(PriceBookError, match="batch_multiplier"):
        book(batch_multiplier=bad)


def test_an_unknown_tier_is_refused():
    with pytest.raises(PriceBookError, match="tier"):
        book().multiplier(NOON, tier="urgent")


def test_a_repeated_request_id_keeps_the_first_row(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))

    async def main():
        first = ledger.record(row("batch_1-line-7", 0.4, "batch", "batch_1"))
        again = ledger.record(row("batch_1-line-7", 0.9, "batch", "batch_1"))  # same batch
        other = ledger.record(row("chatcmpl-x", 0.2))
        return await first, await again, await other

    assert asyncio.run(main()) == (True, False, True)
    later = ledger.record(row("batch_1-line-7", 0.7, "batch", "batch_1"))  # a later batch
    assert later is None
    ledger.flush()
    db = sqlite3.connect(ledger.path)
    rows = db.execute("SELECT id, cost_total, tier, batch_id FROM requests ORDER BY id").fetchall()
    assert rows == [("batch_1-line-7", 0.4, "batch", "batch_1"),
                    ("chatcmpl-x", 0.2, "online", None)]
    (total,) = ledger.totals("all")
    assert (total["requests"], total["batch_requests"]) == (2, 1)
    assert total["cost_total"] == pytest.approx(0.6) and total["cost_batch"] == 0.4
    assert ledger.rows_written == 2
    ledger.close()


def test_an_older_ledger_gains_the_tier_columns(tmp_path):
    path = str(tmp_path / "old.sqlite3")
    db = sqlite3.connect(path)  # the schema before tiers: `kind` last
    db.execute("CREATE TABLE requests (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
               "key_name TEXT, model TEXT, created REAL NOT NULL, finished REAL NOT NULL, "
               "priority INTEGER, cache_hit_tokens INTEGER NOT NULL, cache_miss_tokens "
               "INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cost_cache_hit REAL NOT "
               "NULL, cost_cache_miss REAL NOT NULL, cost_output REAL NOT NULL, cost_total "
               "REAL NOT NULL, price_multiplier REAL NOT NULL, queue_seconds REAL, "
               "ttft_seconds REAL, e2e_seconds REAL, finish_reason TEXT, status TEXT NOT "
               "NULL, kind TEXT)")
    db.execute("INSERT INTO requests VALUES ('old', 't', 'k', 'm', 1, 2, 0, 1, 2, 3, 0.1, 0.1, "
               "0.2, 0.4, 1.0, 0, 0, 0, 'stop', 'ok', 'chat')")
    db.commit()
    db.close()
    ledger = Ledger(path)
    ledger.record(row("new", 0.2, "batch", "batch_9"))
    ledger.flush()
    got = sqlite3.connect(path).execute(
        "SELECT id, tier, batch_id FROM requests ORDER BY id").fetchall()
    assert got == [("new", "batch", "batch_9"), ("old", "online", None)]
    ledger.close()


def test_a_batch_line_run_again_after_a_restart_is_billed_once(tmp_path):
    """The first gateway billed the line and died; the next one runs it again under the
    same request id: the ledger keeps one row and the budget counts it once."""
    path = str(tmp_path / "ledger.sqlite3")
    tenant = Tenant("t", budget_usd=1.0)

    async def first_gateway():
        store = EmbeddedBudgets(Ledger(path))
        reservation = await store.reserve(tenant, 0.5, "batch_1-line-3")
        assert await store.settle(reservation, row("batch_1-line-3", 0.3, "batch", "batch_1"))
        await store.close()

    async def next_gateway():
        store = EmbeddedBudgets(Ledger(path))
        reservation = await store.reserve(tenant, 0.5, "batch_1-line-3")
        committed = await store.settle(reservation, row("batch_1-line-3", 0.35, "batch",
                                                        "batch_1"))
        await asyncio.sleep(0)  # the budget's correction runs as the future's callback
        _, account = store.book.account(tenant)
        spent, reserved = account.spent, account.reserved
        # what is left is 1.0 - 0.3: a reservation of 0.75 is refused, 0.65 taken
        with pytest.raises(BudgetExceeded):
            await store.reserve(tenant, 0.75, "next")
        await store.reserve(tenant, 0.65, "next")
        await store.close()
        return committed, spent, reserved

    asyncio.run(first_gateway())
    committed, spent, reserved = asyncio.run(next_gateway())
    assert committed is False
    assert spent == pytest.approx(0.3, rel=1e-12) and reserved == pytest.approx(0.0, abs=1e-15)
    rows = sqlite3.connect(path).execute("SELECT id, cost_total FROM requests").fetchall()
    assert rows == [("batch_1-line-3", 0.3)]


def test_the_accounting_prices_and_marks_a_batch_line_by_its_tier(tmp_path):
    """Reserved and billed at the batch multiplier; the row and the finished event carry
    the tier and the batch id; revenue is kept by tier."""
    key = ApiKey("00" * 32, Tenant("t", budget_usd=10.0), "k")
    prices = PriceBook.preset("seed")  # no windows: multiplier 1 online, 0.5 batch

    async def main():
        store = EmbeddedBudgets(Ledger(str(tmp_path / "ledger.sqlite3")))
        from billing.embedded_stores import EmbeddedLimits
        accounting = Accounting(InFlightTable(), prices, store, EmbeddedLimits())
        events = []
        accounting.subscribe(events.append)
        gens = {}
        for tier in ("online", "batch"):
            gen = Record(
                request_id=f"chatcmpl-{tier}", params=SamplingParams(max_tokens=100),
                prompt=[1] * 1000, n=1, charge=None, tier=tier,
                batch_id="batch_7" if tier == "batch" else None)
            await accounting.admit(gen, key)
            gens[tier] = gen
        reserved = {t: g.charge.reservation.amount for t, g in gens.items()}
        assert accounting.batch_open == {gens["batch"]}
        for gen in gens.values():  # settled as the worker's last output would
            gen.charge.cost = prices.cost(0, 1000, 50, gen.charge.multiplier)
            gen.__dict__.update(prompt_tokens=1000, cached_tokens=0, completion_tokens=50,
                                finish_reasons={0: "stop"}, worker_timing=None, worker=None,
                                priority=0, enqueued_at=1.0, dispatched_at=1.5,
                                first_token_at=2.0, settled_at=None, trace_headers=None,
                                phase=None)
            gen.charge.statuses.add("ok")
            accounting.table = SimpleNamespace(move=lambda *a: None)
            accounting.settle(gen)
        await asyncio.gather(*(g.committed for g in gens.values()))
        await store.close()
        return reserved, events, accounting

    reserved, events, accounting = asyncio.run(main())
    assert reserved["batch"] == pytest.approx(reserved["online"] / 2, rel=1e-15)
    by_tier = {e.tier: e for e in events}
    assert by_tier["batch"].batch_id == "batch_7" and by_tier["online"].batch_id is None
    assert by_tier["batch"].price_multiplier == 0.5
    assert by_tier["batch"].cost.total == pytest.approx(by_tier["online"].cost.total / 2)
    assert accounting.revenue_by_tier["batch"].total == by_tier["batch"].cost.total
    assert not accounting.batch_open
    rows = sqlite3.connect(str(tmp_path / "ledger.sqlite3")).execute(
        "SELECT tier, batch_id, price_multiplier FROM requests ORDER BY tier").fetchall()
    assert rows == [("batch", "batch_7", 0.5), ("online", None, 1.0)]
