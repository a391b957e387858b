"""Atomic budgets: a request reserves its largest possible cost before it is queued and
settles to its real cost when it ends, so concurrent requests can never overspend.

All of this runs on the gateway's one event loop, so check-and-reserve is atomic without locks.
Spending so far in a period is read once from the ledger, so budgets survive a restart.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


class BudgetExceeded(Exception):
    def __init__(self, tenant: str, budget: float, committed: float, needed: float):
        super().__init__(f"tenant {tenant!r} has ${budget - committed:.6f} of its "
                         f"${budget:.2f} budget left; this request may cost up to "
                         f"${needed:.6f}")


def period_start(period: str, now: dt.datetime | None = None) -> dt.datetime:
    now = now or dt.datetime.now(dt.UTC)
    if period == "day":
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass
class Account:
    spent: float = 0.0
    reserved: float = 0.0


@dataclass(eq=False)
class Reservation:
    tenant: str
    period: str  # the period's start, ISO
    amount: float
    settled: bool = False
    request_id: str = ""  # a shared store's key for it (the request's ledger id)


class BudgetBook:
    def __init__(self, spent_since=None):
        """`spent_since(tenant, start_timestamp) -> dollars` reads the ledger."""
        self.spent_since = spent_since
        self.accounts: dict[tuple[str, str], Account] = {}

    def account(self, tenant, now: dt.datetime | None = None) -> tuple[str, Account]:
        start = period_start(tenant.budget_period, now)
        key = (tenant.name, start.isoformat())
        acct = self.accounts.get(key)
        if acct is None:
            spent = self.spent_since(tenant.name, start.timestamp()) if self.spent_since else 0.0
            acct = self.accounts[key] = Account(spent=spent)
        return key[1], acct

    def reserve(self, tenant, amount: float) -> Reservation:
        period, acct = self.account(tenant)
        if tenant.budget_usd > 0 and acct.spent + acct.reserved + amount > tenant.budget_usd:
            raise BudgetExceeded(tenant.name, tenant.budget_usd, acct.spent + acct.reserved,
                                 amount)
        acct.reserved += amount
        return Reservation(tenant.name, period, amount)

    def settle(self, reservation: Reservation, actual: float) -> None:
        """Replace the reservation by the real cost (exactly once)."""
        if reservation.settled:
            return
        reservation.settled = True
        acct = self.accounts[(reservation.tenant, reservation.period)]
        acct.reserved -= reservation.amount
        acct.spent += actual

    def unspend(self, reservation: Reservation, amount: float) -> None:
        """Take back what a settlement counted as spent, when the ledger shows that request
        was billed before (its row was already there)."""
        acct = self.accounts.get((reservation.tenant, reservation.period))
        if acct is not None:
            acct.spent -= amount

    def total_reserved(self) -> float:
        return sum(a.reserved for a in self.accounts.values())
