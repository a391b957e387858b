"""The shared ledger as its readers call the SQLite one: plain methods, from a worker thread
(/admin/usage runs `flush` and `totals` through asyncio.to_thread). Each call runs on the
gateway's event loop, where the PostgreSQL pool lives, and the thread waits for its answer."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from billing.stores import StoreUnavailable

READ_TIMEOUT = 30.0


class PgLedger:
    def __init__(self, store: Any):
        self.store = store  # a PgBudgets: drain(), totals(), spent_since()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the store starts

    def _run(self, coro, timeout: float):
        loop = self.loop
        if loop is None:
            coro.close()
            raise RuntimeError("the shared ledger has not been started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # waiting here would block the very loop that must answer
            coro.close()
            raise RuntimeError("call the shared ledger from a worker thread, not its loop")
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
        except concurrent.futures.TimeoutError:
            raise StoreUnavailable("PostgreSQL", f"no answer in {timeout:g} s") from None

    def flush(self, timeout: float = READ_TIMEOUT) -> None:
        """Wait until every settlement begun so far reached PostgreSQL or the outbox (as the
        SQLite ledger's flush, it gives up quietly after `timeout`)."""
        try:
            self._run(self.store.drain(), timeout)
        except StoreUnavailable:
            pass

    def totals(self, period: str = "day", since: float | None = None,
               until: float | None = None, tenant: str | None = None) -> list[dict]:
        return self._run(self.store.totals(period, since, until, tenant), READ_TIMEOUT)

    def spent_since(self, tenant: str, since: float) -> float:
        return self._run(self.store.spent_since(tenant, since), READ_TIMEOUT)
