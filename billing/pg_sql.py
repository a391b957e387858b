"""The PostgreSQL schema and the statements that make shared budgets safe.

Every change of money is one SQL statement, so it is atomic whatever else runs on any other
gateway, and none needs an explicit transaction or a retry loop:

- RESERVE adds to `reserved` only WHERE spent + reserved + amount <= budget, and records the
  reservation in the same statement. Concurrent reservations of one tenant queue on its period
  row; under READ COMMITTED each one waiting re-checks the condition on the row as the one
  before it left it, so together they can never pass the budget.
- SETTLE deletes the reservation, inserts the ledger row ON CONFLICT (id) DO NOTHING and moves
  the amounts, all in one statement: run again (a retry after a lost answer, a replay from the
  outbox) it finds no reservation and a row already there, and changes nothing. A request run
  again under the same id (a batch line after its gateway died) made a new reservation: that
  is given back, and as the row is there, `spent` stays as it was.
- REAP returns reservations whose gateway died before settling them (they expire); a late
  settlement still bills its row, as SETTLE moves `spent` whenever it inserts the row.

Money that is compared against budgets (`budget_periods`, `reservations`) is NUMERIC: sums of
reservations return exactly to zero. The ledger keeps the SQLite ledger's columns (LedgerRow).
"""
from __future__ import annotations

from dataclasses import fields

from billing.ledger import LedgerRow

SCHEMA_LOCK = 0x1F5E_57A7  # advisory lock: gateways starting together create the schema once

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_name TEXT, model TEXT,
    created DOUBLE PRECISION NOT NULL, finished DOUBLE PRECISION NOT NULL, priority INTEGER,
    cache_hit_tokens BIGINT NOT NULL, cache_miss_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    cost_cache_hit DOUBLE PRECISION NOT NULL, cost_cache_miss DOUBLE PRECISION NOT NULL,
    cost_output DOUBLE PRECISION NOT NULL, cost_total DOUBLE PRECISION NOT NULL,
    price_multiplier DOUBLE PRECISION NOT NULL,
    queue_seconds DOUBLE PRECISION, ttft_seconds DOUBLE PRECISION,
    e2e_seconds DOUBLE PRECISION, finish_reason TEXT, status TEXT NOT NULL, kind TEXT,
    tier TEXT NOT NULL DEFAULT 'online', batch_id TEXT
);
ALTER TABLE requests ADD COLUMN IF NOT EXISTS kind TEXT;
ALTER TABLE requests ADD COLUMN IF NOT EXISTS tier TEXT NOT NULL DEFAULT 'online';
ALTER TABLE requests ADD COLUMN IF NOT EXISTS batch_id TEXT;
CREATE INDEX IF NOT EXISTS requests_tenant_created ON requests (tenant, created);
CREATE TABLE IF NOT EXISTS budget_periods (
    tenant TEXT NOT NULL, period TEXT NOT NULL,
    spent NUMERIC NOT NULL DEFAULT 0, reserved NUMERIC NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, period)
);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, period TEXT NOT NULL,
    amount NUMERIC NOT NULL, expires TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_expires ON reservations (expires);
"""

LEDGER_COLUMNS = tuple(f.name for f in fields(LedgerRow))  # SCHEMA's `requests` names them all

# $1 tenant, $2 period (ISO start), $3 its start (unix seconds): spending the ledger already
# holds for the period seeds a new row, so budgets read the ledger as the embedded book does
ENSURE_PERIOD = """
INSERT INTO budget_periods (tenant, period, spent, reserved)
SELECT $1, $2, COALESCE(SUM(cost_total), 0)::numeric, 0
FROM requests WHERE tenant = $1 AND created >= $3
ON CONFLICT (tenant, period) DO NOTHING
"""

# $1 tenant, $2 period, $3 amount, $4 budget (<= 0: unlimited), $5 request id, $6 TTL (s);
# a row back means reserved, none means over budget or no period row yet
RESERVE = """
WITH account AS (
    UPDATE budget_periods SET reserved = reserved + $3::numeric
    WHERE tenant = $1 AND period = $2
      AND ($4::numeric <= 0 OR spent + reserved + $3::numeric <= $4::numeric)
    RETURNING tenant
)
INSERT INTO reservations (id, tenant, period, amount, expires)
SELECT $5, $1, $2, $3::numeric, now() + make_interval(secs => $6::float8) FROM account
RETURNING id
"""

COMMITTED = "SELECT spent + reserved FROM budget_periods WHERE tenant = $1 AND period = $2"

_VALUES = ", ".join(f"${i}" for i in range(4, 4 + len(LEDGER_COLUMNS)))

# $1 request id, $2 tenant, $3 period, then the ledger row's columns in LEDGER_COLUMNS order;
# `spent` grows only when this very statement inserted the row
SETTLE = f"""
WITH held AS (
    DELETE FROM reservations WHERE id = $1 RETURNING amount
), billed AS (
    INSERT INTO requests ({", ".join(LEDGER_COLUMNS)}) VALUES ({_VALUES})
    ON CONFLICT (id) DO NOTHING RETURNING cost_total
)
UPDATE budget_periods
SET reserved = reserved - COALESCE((SELECT amount FROM held), 0),
    spent = spent + COALESCE((SELECT cost_total FROM billed), 0)::numeric
WHERE tenant = $2 AND period = $3
  AND (EXISTS (SELECT 1 FROM held) OR EXISTS (SELECT 1 FROM billed))
"""

# $1 request id: a reservation given back unspent (the request never ran)
RELEASE = """
WITH held AS (
    DELETE FROM reservations WHERE id = $1 RETURNING tenant, period, amount
)
UPDATE budget_periods b SET reserved = b.reserved - held.amount
FROM held WHERE b.tenant = held.tenant AND b.period = held.period
"""

REAP = """
WITH gone AS (
    DELETE FROM reservations WHERE expires < now() RETURNING tenant, period, amount
), sums AS (
    SELECT tenant, period, SUM(amount) AS amount FROM gone GROUP BY tenant, period
)
UPDATE budget_periods b SET reserved = b.reserved - sums.amount
FROM sums WHERE b.tenant = sums.tenant AND b.period = sums.period
"""

SPENT_SINCE = ("SELECT COALESCE(SUM(cost_total), 0) FROM requests "
               "WHERE tenant = $1 AND created >= $2")

# the SQLite ledger's buckets (strftime over unix seconds, UTC), spelled for PostgreSQL
BUCKETS = {"hour": "'YYYY-MM-DD\"T\"HH24:00'", "day": "'YYYY-MM-DD'", "month": "'YYYY-MM'"}


def totals_query(period: str, since: float | None, until: float | None,
                 tenant: str | None) -> tuple[str, list]:
    """The SQLite ledger's `totals` query: sums per tenant and bucket, newest first."""
    bucket = "'all'" if period == "all" else \
        f"to_char(to_timestamp(created) AT TIME ZONE 'UTC', {BUCKETS[period]})"
    where, args = ["TRUE"], []
    for clause, value in (("created >= ", since), ("created < ", until),
                          ("tenant = ", tenant)):
        if value is not None:
            args.append(value)
            where.append(f"{clause}${len(args)}")
    # COLLATE "C": ordered by bytes, as SQLite orders them
    sql = (f'SELECT tenant COLLATE "C", ({bucket}) COLLATE "C", COUNT(*), '
           f"SUM(cache_hit_tokens)::bigint, SUM(cache_miss_tokens)::bigint, "
           f"SUM(output_tokens)::bigint, SUM(cost_cache_hit), SUM(cost_cache_miss), "
           f"SUM(cost_output), SUM(cost_total), COUNT(*) FILTER (WHERE tier = 'batch'), "
           f"COALESCE(SUM(cost_total) FILTER (WHERE tier = 'batch'), 0) "
           f"FROM requests WHERE {' AND '.join(where)} "
           f"GROUP BY 1, 2 ORDER BY 2 DESC, 1")
    return sql, args
