"""Which stores a gateway uses: shared ones where a URL is given, the embedded ones otherwise.

The shared backends are imported only when asked for, so a gateway without --state-url or
--redis-url never loads asyncpg or redis.
"""
from __future__ import annotations

from billing.embedded_stores import EmbeddedBudgets, EmbeddedLimits
from billing.fairshare import FairShare
from billing.ledger import Ledger
from billing.stores import BudgetStore, LimitStore


def budget_store(ledger_path: str, state_url: str | None = None) -> BudgetStore:
    """PostgreSQL at `state_url` (its outbox beside the local ledger's path), else the
    in-process book over the SQLite ledger at `ledger_path`."""
    if state_url:
        from billing.pg_budgets import PgBudgets
        return PgBudgets(state_url, outbox_path(ledger_path))
    return EmbeddedBudgets(Ledger(ledger_path))


def limit_store(fair_tokens_per_second: float, redis_url: str | None = None) -> LimitStore:
    if redis_url:
        from billing.redis_limits import RedisLimits
        return RedisLimits(redis_url, fair_tokens_per_second)
    return EmbeddedLimits(FairShare(fair_tokens_per_second))


def outbox_path(ledger_path: str) -> str:
    """Settlements waiting for PostgreSQL: a file of this gateway's, where its SQLite ledger
    would be (gateways on one machine with distinct --ledger-path keep distinct outboxes)."""
    return ledger_path + ".outbox"
