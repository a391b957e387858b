"""The default stores, all in this process: `BudgetBook` over the SQLite ledger, and
`RateLimiter` with `FairShare`. One gateway owns them; everything runs on its event loop, so
each method finishes without suspending and check-and-charge needs no lock."""
from __future__ import annotations

import asyncio

from billing.budget import BudgetBook, Reservation
from billing.fairshare import FairShare
from billing.keys import Tenant
from billing.ledger import Ledger, LedgerRow
from billing.ratelimit import RateLimiter


class EmbeddedBudgets:
    def __init__(self, ledger: Ledger | None):
        self.ledger = ledger
        self.book = BudgetBook(ledger.spent_since if ledger else None)

    async def start(self) -> None:
        pass

    async def reserve(self, tenant: Tenant, amount: float, request_id: str) -> Reservation:
        return self.book.reserve(tenant, amount)

    def release(self, reservation: Reservation) -> None:
        self.book.settle(reservation, 0.0)

    def settle(self, reservation: Reservation, row: LedgerRow) -> asyncio.Future | None:
        """Spent grows at once (a budget errs on the side of refusing), and is given back
        when the ledger finds it already held this request id's row: a settlement repeated
        (a batch line run again after a crash) is billed once."""
        self.book.settle(reservation, row.cost_total)
        if self.ledger is None:
            return None
        committed = self.ledger.record(row)
        if committed is not None:
            committed.add_done_callback(
                lambda f: self._unless_new(f, reservation, row.cost_total))
        return committed

    def _unless_new(self, committed: asyncio.Future, reservation: Reservation,
                    cost: float) -> None:
        if committed.cancelled() or committed.exception() is not None:
            return  # not written: it stays counted, as the budget cannot tell
        if committed.result() is False:
            self.book.unspend(reservation, cost)

    def total_reserved(self) -> float:
        return self.book.total_reserved()

    async def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


class EmbeddedLimits:
    def __init__(self, fair: FairShare | None = None, limiter: RateLimiter | None = None):
        self.fair = fair or FairShare()
        self.limiter = limiter or RateLimiter()

    async def start(self) -> None:
        pass

    async def take_request(self, tenant: Tenant) -> float:
        return self.limiter.take_request(tenant)

    async def take_tokens(self, tenant: Tenant, tokens: int) -> float:
        return self.limiter.take_tokens(tenant, tokens)

    async def start_time(self, tenant: Tenant, tokens: int) -> float:
        return self.fair.start(tenant.name, tenant.weight, tokens)

    def refund(self, tenant: Tenant, tokens: int) -> None:
        self.limiter.refund(tenant, tokens)

    def correct(self, tenant: Tenant, estimated: int, actual: int) -> None:
        self.fair.correct(tenant.name, tenant.weight, estimated, actual)

    async def close(self) -> None:
        pass
