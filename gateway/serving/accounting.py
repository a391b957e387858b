"""Tenants and money on the request's path: admit (rate limit, budget reservation, fair-share
start), then meter every worker output, and settle once when the request ends.

Settlement happens exactly once per request whatever ends it: every choice finished (billed
for what it produced, an abort included), dropped from the queue before any worker saw it
(not billed), or lost with a crashed worker or refused by it (not billed: our fault). It
returns the reservation, refunds unused rate-limit tokens, corrects the fair-share clock and
writes the ledger row. The row's commit is a future on the request's record (`committed`): an
answer's final usage waits for it, so a client never holds a bill the ledger could lose.

Budgets and the ledger live in a `BudgetStore`, rate limits and the fair-share clock in a
`LimitStore` (billing/stores.py): in this process by default, or shared by several
gateways in PostgreSQL and Redis. The calls are the same; a shared store that cannot be
reached refuses the request with 503 and Retry-After, so nothing runs unmetered.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from billing.budget import BudgetExceeded, Reservation
from billing.keys import ApiKey
from billing.ledger import LedgerRow
from billing.pricing import TIERS, ZERO_COST, Cost, PriceBook
from billing.request_finished import FAILED, RequestFinished
from billing.stores import BudgetStore, LimitStore, StoreUnavailable
from contract.frames import Output
from contract.outputs import wall_clock
from gateway.errors import APIError, payment_required, rate_limited, store_unavailable
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase

log = logging.getLogger(__name__)


@dataclass
class Charge:
    key: ApiKey
    reservation: Reservation
    tokens_charged: int  # against the tokens-per-minute bucket
    multiplier: float  # time-of-day price multiplier at admission
    virtual_start: float
    subs_left: int
    cost: Cost = ZERO_COST
    statuses: set = field(default_factory=set)
    settled: bool = False


class Accounting:
    def __init__(self, table: InFlightTable, prices: PriceBook, budgets: BudgetStore,
                 limits: LimitStore, model: str = "model"):
        self.table = table  # the requests in flight, by engine request id
        self.prices = prices
        self.budgets = budgets
        self.ledger = budgets.ledger  # what /admin/usage reads
        self.limits = limits
        self.model = model
        self.revenue = ZERO_COST  # since start, for metrics
        self.revenue_by_tier = dict.fromkeys(TIERS, ZERO_COST)
        self.batch_open: set[InFlightRequest] = set()  # batch lines admitted, not settled
        # called just before a settlement takes a request off its worker: the busy-time
        # split by tier (gateway/telemetry/tier_usage.py) looks at the mix it had
        self.before_settle: list[Callable[[], None]] = []
        # callbacks: metrics, traces, the live feed
        self._subscribers: list[Callable[[RequestFinished], None]] = []

    async def start(self) -> None:
        await self.budgets.start()
        await self.limits.start()

    async def close(self) -> None:
        await self.budgets.close()
        await self.limits.close()

    # ---- admission ----------------------------------------------------------------------
    async def take_request(self, key: ApiKey) -> None:
        """Count the request against the tenant's requests per minute before any work is done
        for it (tokenizing, the chat template), or raise 429: refusals cost the sender too."""
        _raise_if_waiting(key.tenant, await _or_503(self.limits.take_request(key.tenant)))

    async def admit(self, gen, key: ApiKey) -> None:
        """Charge the token rate limit, reserve the largest possible cost and take a
        fair-share start, or raise 429 / 402 / 503. Follows `take_request`. The charge runs
        on to its end even if the client leaves meanwhile, and is then given back: a
        reservation a shared store made is never left behind by a cancelled wait."""
        charging = asyncio.ensure_future(self._charge(gen, key))
        try:
            gen.charge = await asyncio.shield(charging)
        except asyncio.CancelledError:
            charging.add_done_callback(self._give_back)
            raise
        if tier_of(gen) == "batch":
            self.batch_open.add(gen)

    async def _charge(self, gen, key: ApiKey) -> Charge:
        tenant = key.tenant
        max_output = gen.params.max_tokens * gen.n
        tokens = len(gen.prompt) + max_output
        _raise_if_waiting(tenant, await _or_503(self.limits.take_tokens(tenant, tokens)))
        # the record's tier prices it: a batch line at the batch multiplier, reserved so too
        multiplier = self.prices.multiplier(tier=tier_of(gen))
        worst = self.prices.cost(0, len(gen.prompt), max_output, multiplier).total
        try:
            reservation = await self.budgets.reserve(tenant, worst, gen.request_id)
        except BaseException as exc:
            self.limits.refund(tenant, tokens)
            if isinstance(exc, BudgetExceeded):
                raise payment_required(str(exc)) from None
            if isinstance(exc, StoreUnavailable):
                raise _unavailable(exc) from None
            raise
        try:
            start = await _or_503(self.limits.start_time(tenant, tokens))
        except BaseException:
            self.budgets.release(reservation)
            self.limits.refund(tenant, tokens)
            raise
        return Charge(key, reservation, tokens, multiplier, start, gen.n)

    def _give_back(self, charging: asyncio.Future) -> None:
        """A charge whose client left before it was made: return all of it."""
        if charging.cancelled() or charging.exception() is not None:
            return  # refused, or failed: it gave back what it had taken itself
        charge = charging.result()
        tenant = charge.key.tenant
        self.budgets.release(charge.reservation)
        self.limits.refund(tenant, charge.tokens_charged)
        self.limits.correct(tenant, charge.tokens_charged, 0)

    def batch_sequences(self) -> dict[int, int]:
        """Sequences of batch lines on each worker (index), dispatched and not settled."""
        on: dict[int, int] = {}
        for gen in self.batch_open:
            if gen.worker is not None and gen.phase in (Phase.DISPATCHED, Phase.STREAMING):
                on[gen.worker.index] = on.get(gen.worker.index, 0) + gen.n
        return on

    def subscribe(self, callback) -> None:
        """Call `callback(RequestFinished)` for every request that settles from now on."""
        self._subscribers.append(callback)

    # ---- metering -----------------------------------------------------------------------
    def on_output(self, out: Output) -> None:
        """Called for every worker output before the client's stream sees it: the request's
        first token and its end are noted here, at arrival, whoever reads the stream."""
        gen = self.table.get(out["id"])
        if gen is None or gen.charge is None:
            return
        if gen.first_token_at is None and out["tokens"]:
            gen.first_token_at = time.monotonic()
            self.table.move(gen, Phase.STREAMING)
        if not out["finished"]:
            return
        charge = gen.charge
        if out.get("reason"):
            gen.finish_reasons[gen.choice_of(out["id"])] = out["reason"]
        if out.get("timing") and gen.worker_timing is None:
            gen.worker_timing = out["timing"]
        usage = out.get("usage")
        if usage is not None:
            prompt, cached, completion = usage
            first = gen.prompt_tokens == 0  # input is billed once for n choices
            if first:
                gen.prompt_tokens, gen.cached_tokens = prompt, cached
            gen.completion_tokens += completion
            charge.cost += self.prices.cost(cached if first else 0,
                                            prompt - cached if first else 0, completion,
                                            charge.multiplier)
        charge.statuses.add(_status(out.get("reason")))
        charge.subs_left -= 1
        if charge.subs_left <= 0:
            self.settle(gen)

    def drop(self, gen, status: str) -> None:
        """The request ended before any worker output: nothing produced, nothing billed."""
        if gen.charge is None:
            return
        gen.charge.statuses.add(status)
        self.settle(gen)

    def settle(self, gen) -> None:
        charge = gen.charge
        if charge.settled:
            return
        charge.settled = True
        gen.settled_at = time.monotonic()
        for look in self.before_settle:
            try:
                look()
            except Exception:  # noqa: BLE001 - a telemetry fault must never stop a bill
                log.exception("the busy-time look before a settlement failed")
        tier = tier_of(gen)
        if tier == "batch":
            self.batch_open.discard(gen)
        self.table.move(gen, Phase.SETTLING)
        tenant = charge.key.tenant
        if charge.statuses & set(FAILED):  # our refusal or our fault: nothing is billed
            gen.prompt_tokens = gen.cached_tokens = gen.completion_tokens = 0
            charge.cost = ZERO_COST  # so the row's tokens and cost agree (and are 0)
        used = gen.prompt_tokens + gen.completion_tokens
        self.limits.refund(tenant, max(0, charge.tokens_charged - used))
        self.limits.correct(tenant, charge.tokens_charged, used)
        self.revenue += charge.cost
        self.revenue_by_tier[tier] = self.revenue_by_tier.get(tier, ZERO_COST) + charge.cost
        event = self._finished(gen)
        for callback in self._subscribers:
            callback(event)
        # the reservation becomes the real cost and the ledger row, in one step of the store
        gen.committed = self.budgets.settle(charge.reservation, ledger_row(event))
        if gen.committed is None:
            self.table.move(gen, Phase.DONE)
            return
        gen.committed.add_done_callback(lambda _: self.table.move(gen, Phase.DONE))

    def _finished(self, gen: InFlightRequest) -> RequestFinished:
        c, worker = gen.charge, gen.worker
        status = next((s for s in ("error", "rejected", "cancelled") if s in c.statuses), "ok")
        return RequestFinished(
            gen.request_id, c.key.tenant.name, c.key.name, self.model, gen.priority, status,
            gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens, c.cost,
            c.multiplier, tuple(r for _, r in sorted(gen.finish_reasons.items())),
            gen.enqueued_at or gen.settled_at, gen.dispatched_at, gen.first_token_at,
            gen.settled_at, worker.index if worker is not None else None,
            worker.info.device if worker is not None and worker.info else None,
            gen.trace_headers, gen.worker_timing, tier_of(gen), getattr(gen, "batch_id", None))


# the API a request came through, by its id: each endpoint names its ids its own way (chat's
# and completions' ids on the WebSocket too); the ledger's `kind` (billing/ledger.py KINDS)
ID_KINDS = (("chatcmpl-", "chat"), ("cmpl-", "completions"), ("resp_", "responses"),
            ("msg_", "messages"))


def tier_of(gen) -> str:
    """The record's tier (billing.pricing.TIERS); "online" for a stand-in without one."""
    return getattr(gen, "tier", "online")


def kind_of(request_id: str) -> str | None:
    return next((kind for prefix, kind in ID_KINDS if request_id.startswith(prefix)), None)


def ledger_row(event: RequestFinished) -> LedgerRow:
    cost = event.cost
    return LedgerRow(
        event.request_id, event.tenant, event.key_name, event.model,
        wall_clock(event.enqueued_at), wall_clock(event.settled_at), event.priority,
        event.cached_tokens, event.miss_tokens, event.completion_tokens,
        cost.cache_hit_input, cost.cache_miss_input, cost.output, cost.total,
        event.price_multiplier, event.queue_seconds, event.ttft_seconds, event.e2e_seconds,
        event.reasons_text, event.status, kind_of(event.request_id), event.tier,
        event.batch_id)


async def wait_committed(gen, timeout: float = 30.0) -> None:
    """Wait until the request's ledger row is committed (raises if it could not be)."""
    future = getattr(gen, "committed", None)
    if future is None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(future), timeout)
    except Exception as exc:  # noqa: BLE001 - a lost row must not look like a finished bill
        raise APIError(500, "the request finished but its usage could not be recorded; "
                       "it is not billed", "server_error", code="ledger_unavailable") from exc


async def _or_503(check):
    """Await a limit store's check; an unreachable store refuses the request (503)."""
    try:
        return await check
    except StoreUnavailable as exc:
        raise _unavailable(exc) from None


def _unavailable(exc: StoreUnavailable) -> APIError:
    # the store's role, not its address or error: those are for the gateway's log
    role = {"PostgreSQL": "budgets", "Redis": "rate limits"}.get(exc.store, "accounts")
    return store_unavailable(f"the request was not admitted: the store of {role} cannot be "
                             f"reached right now; retry shortly", retry_after_s=exc.retry_after)


def _raise_if_waiting(tenant, wait: float) -> None:
    if wait > 0:
        raise rate_limited(f"tenant {tenant.name!r} is over its rate limit",
                           retry_after_s=wait if wait != float("inf") else 60)


def _status(reason: str | None) -> str:
    return {"abort": "cancelled", "error": "error", "rejected": "rejected"}.get(reason, "ok")
