"""The two stores accounting works through, whichever backend holds them.

`BudgetStore` holds money: budget reservations and the ledger of finished requests.
Embedded (default): `BudgetBook` and the SQLite `Ledger` in this process
(billing/embedded_stores.py); shared: PostgreSQL (billing/pg_budgets.py).

`LimitStore` holds pace: per-tenant token buckets (requests and tokens per minute) and the
fair-share virtual clock. Embedded: `RateLimiter` and `FairShare`; shared: Redis
(billing/redis_limits.py).

Invariants every backend keeps, however many gateways share it:
- `reserve` is atomic: spent + reserved never exceeds a tenant's budget;
- `settle` takes effect once per request id, however often it is retried: one ledger row;
- a reservation counts as reserved until its settlement has reached the store;
- a store that cannot be reached raises `StoreUnavailable`, never answers "allowed": the
  caller fails closed (503), and no work is admitted that could not be billed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from billing.budget import Reservation
from billing.keys import Tenant
from billing.ledger import LedgerRow

log = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """A shared store did not answer in time (down, unreachable, overloaded)."""

    def __init__(self, store: str, cause: BaseException | str, retry_after: float = 2.0):
        super().__init__(f"{store} is unavailable: {cause}")
        self.store = store
        self.retry_after = retry_after


class LedgerReader(Protocol):
    """What /admin/usage and the shutdown read of a ledger; called from a worker thread."""

    def flush(self, timeout: float = 30.0) -> None: ...

    def totals(self, period: str = "day", since: float | None = None,
               until: float | None = None, tenant: str | None = None) -> list[dict]: ...

    def spent_since(self, tenant: str, since: float) -> float: ...


class BudgetStore(Protocol):
    @property
    def ledger(self) -> LedgerReader | None: ...

    async def start(self) -> None: ...

    async def reserve(self, tenant: Tenant, amount: float, request_id: str) -> Reservation:
        """Hold `amount` of the tenant's budget, or raise BudgetExceeded / StoreUnavailable."""

    def release(self, reservation: Reservation) -> None:
        """Give a reservation back unspent: the request was never admitted (no ledger row)."""

    def settle(self, reservation: Reservation, row: LedgerRow) -> asyncio.Future | None:
        """Replace the reservation by `row.cost_total` and write `row`, exactly once. The
        future resolves once that is durable; None when there is nothing to wait for."""

    def total_reserved(self) -> float:
        """Dollars this gateway has reserved and not yet settled in the store."""

    async def close(self) -> None: ...


class LimitStore(Protocol):
    async def start(self) -> None: ...

    async def take_request(self, tenant: Tenant) -> float:
        """Charge one request (0), or the seconds to wait. Never refunded."""

    async def take_tokens(self, tenant: Tenant, tokens: int) -> float:
        """Charge tokens (0), or the seconds to wait (inf: they never fit)."""

    async def start_time(self, tenant: Tenant, tokens: int) -> float:
        """A new request's fair-share virtual start, on this process's monotonic clock, and
        advance the tenant's clock by `tokens`."""

    def refund(self, tenant: Tenant, tokens: int) -> None:
        """Return tokens charged but not used (best effort for a shared store)."""

    def correct(self, tenant: Tenant, estimated: int, actual: int) -> None:
        """Charge the fair-share clock for the tokens served instead of the estimate."""

    async def close(self) -> None: ...


class Breaker:
    """Fails fast for `cooldown` seconds after a store could not be reached, so that an outage
    costs each refused request microseconds rather than a connect timeout; the first call
    after the cooldown (or any background retry) probes the store again. Logs each change."""

    def __init__(self, store: str, cooldown: float = 1.0, clock=time.monotonic):
        self.store, self.cooldown, self.clock = store, cooldown, clock
        self.down_since: float | None = None
        self._retry_at = 0.0

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def check(self) -> None:
        if self.down_since is not None and self.clock() < self._retry_at:
            raise StoreUnavailable(self.store, "failing fast after an error; retrying "
                                   "shortly", retry_after=self.cooldown)

    def failed(self, error: BaseException) -> StoreUnavailable:
        now = self.clock()
        if self.down_since is None:
            self.down_since = now
            log.warning("%s is unreachable (%s: %s): failing closed until it answers",
                        self.store, type(error).__name__, error)
        self._retry_at = now + self.cooldown
        return StoreUnavailable(self.store, f"{type(error).__name__}: {error}")

    def succeeded(self) -> None:
        if self.down_since is not None:
            log.warning("%s answers again after %.1f s", self.store,
                        self.clock() - self.down_since)
            self.down_since = None
