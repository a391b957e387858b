"""The batch runner: claims batches from the store, validates their input, feeds their lines
to the online admission path while the workers have idle capacity (gateway/batch/idle.py),
records each line's result once, and ends each batch (completed, expired or cancelled).

Durability and exactly once:
- a gateway holds a batch by a lease in the store (CLAIM renews it every `claim_interval`);
  when the gateway dies another one (or the same one restarted: its owner name is stable)
  takes the batch over once the lease has run out, and runs its lines without a result;
- a line's result is recorded (insert-if-absent on batch and custom_id) only after its
  ledger row was committed (the answer builder waits for the commit), so a line whose result
  is recorded is never run again, and a line run again after a crash settles under the same
  request id (its attempt number is stored), whose ledger row the ledger keeps once;
- a line that could not run for a reason not its own (429, 503, a worker lost) has its attempt
  number raised in the store before it runs again: the failed attempt's zero-cost row and the
  next attempt's row have different ids.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from billing.budget import Reservation
from billing.keys import ApiKey
from gateway.batch.finalize import finalize
from gateway.batch.idle import idle_slots
from gateway.batch.line_run import (
    MAX_ATTEMPTS,
    LineRetry,
    engine_request_id,
    output_line,
    run_line,
)
from gateway.batch.lines import ENDPOINTS, Line, error_line
from gateway.batch.store import BatchStore
from gateway.batch.validation import validate_batch
from gateway.http.auth import DEFAULT_KEY
from gateway.serving.inflight import InFlightRequest, Phase
from gateway.state import GatewayState

log = logging.getLogger(__name__)
TICK = 0.05  # seconds between the runner's turns when nothing wakes it
REFILL = 64  # lines read from the store at a time, per batch
RETRY_SECONDS = 1.0  # a batch whose line hit a limit waits this long before feeding again
ENDED_CODES = {"expired": ("batch_expired", "the batch's completion window ended before "
                           "this request ran"),
               "cancelled": ("batch_cancelled", "the batch was cancelled before this request "
                             "finished")}


@dataclass(frozen=True)
class BatchSettings:
    max_file_bytes: int = 100 << 20
    max_lines: int = 50_000
    max_open: int = 16  # open batches per tenant
    idle_margin: float = 0.1  # of slots and KV blocks kept free for online requests
    max_queued: int = 4  # batch lines admitted and not yet on a worker, at most
    lease_seconds: float = 15.0

    @property
    def claim_interval(self) -> float:
        return min(1.0, self.lease_seconds / 5)


@dataclass(eq=False)
class RunningLine:
    line: Line
    attempt: int
    task: asyncio.Task | None = None
    gen: InFlightRequest | None = None  # once admission made its record

    @property
    def starting(self) -> bool:
        """Admitted or being admitted, and not yet on a worker."""
        return self.gen is None or self.gen.phase in (None, Phase.QUEUED)


@dataclass(eq=False)
class OwnedBatch:
    id: str
    tenant: str
    key_sha256: str
    endpoint: str
    input_file_id: str
    status: str
    expires_at: int
    created_at: int
    waiting: deque = field(default_factory=deque)  # (Line, attempt) to run here
    cursor: int = 0  # lines from this line number on are not read from the store yet
    exhausted: bool = False  # every line without a result has been read
    running: dict[str, RunningLine] = field(default_factory=dict)
    paused_until: float = 0.0  # no new line starts before (a limit hit: Retry-After)
    failed_until: float = 0.0  # its turn failed: not tried again before


def owner_name(ledger_path: str) -> str:
    """This gateway's name on its leases: stable across its restarts (same host and ledger),
    so a restarted gateway resumes its batches at once; distinct for each fleet child."""
    digest = hashlib.blake2b(f"{socket.gethostname()}\0{ledger_path}".encode(), digest_size=8)
    return digest.hexdigest()


class BatchRunner:
    """Runs this gateway's share of the open batches; the state's `batch` (BatchTierView)."""

    def __init__(self, state: GatewayState, store: BatchStore, settings: BatchSettings,
                 owner: str):
        self.state = state
        self.store = store
        self.settings = settings
        self.owner = owner
        self.owned: dict[str, OwnedBatch] = {}
        self._wake = asyncio.Event()
        self._waiting_count = 0
        self._task: asyncio.Task | None = None  # the loop, while it runs
        self.closing = False

    # ---- BatchTierView ------------------------------------------------------------------
    @property
    def batches_open(self) -> int:
        return len(self.owned)

    @property
    def lines_waiting(self) -> int:
        return self._waiting_count

    @property
    def lines_running(self) -> int:
        return sum(len(b.running) for b in self.owned.values())

    def wake(self) -> None:
        self._wake.set()

    def note_cancelling(self, batch_id: str) -> None:
        """A cancel came in here for a batch this gateway runs: act now, not at the next claim."""
        b = self.owned.get(batch_id)
        if b is not None and b.status in ("validating", "in_progress"):
            b.status = "cancelling"
            self.wake()

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._task = asyncio.current_task()
        last_claim = -float("inf")
        while not stop.is_set() and not self.closing:
            try:
                if time.monotonic() - last_claim >= self.settings.claim_interval:
                    last_claim = time.monotonic()
                    await self._claim()
            except Exception:  # noqa: BLE001 - a store outage: the next turn retries
                log.exception("claiming batches failed; retrying")
            for b in sorted(self.owned.values(), key=lambda b: (b.created_at, b.id)):
                if b.failed_until > time.monotonic():
                    continue
                try:
                    await self._advance(b)
                except Exception:  # noqa: BLE001 - this batch waits; the others go on
                    log.exception("batch %s: its turn failed; retrying", b.id)
                    b.failed_until = time.monotonic() + self.settings.claim_interval
            self._feed()
            try:
                await asyncio.wait_for(self._wake.wait(), TICK)
            except TimeoutError:
                pass
            self._wake.clear()

    async def _claim(self) -> None:
        rows = await self.store.claim(self.owner, self.settings.lease_seconds, time.time())
        held = set()
        for bid, tenant, key_sha, endpoint, file_id, status, expires_at, created_at in rows:
            held.add(bid)
            b = self.owned.get(bid)
            if b is None:
                self.owned[bid] = OwnedBatch(bid, tenant, key_sha, endpoint, file_id, status,
                                             int(expires_at), int(created_at))
                log.info("batch %s: running it here (%s)", bid, status)
            else:
                b.expires_at = int(expires_at)
                if status == "cancelling" or b.status == "validating":
                    b.status = status  # cancelled elsewhere, or validated by an earlier owner
        for bid in set(self.owned) - held:  # ended, or taken over after our lease ran out
            self._forget(self.owned.pop(bid))
        waiting = await self.store.lines_waiting()
        self._waiting_count = max(0, waiting - self.lines_running)

    def _forget(self, b: OwnedBatch) -> None:
        for r in b.running.values():
            if r.task is not None:
                r.task.cancel()

    async def _advance(self, b: OwnedBatch) -> None:
        if b.status == "validating" and self.state.service is not None:
            await self._validate(b)
        elif b.status == "in_progress":
            if time.time() >= b.expires_at:
                await self._end(b, "expired")
                return
            if len(b.waiting) < REFILL // 2 and not b.exhausted:
                await self._refill(b)
            if b.exhausted and not b.waiting and not b.running:
                if await self.store.unfinished(b.id):  # a line lost in memory: read again
                    b.cursor, b.exhausted = 0, False
                    return
                if await self.store.move(b.id, "finalizing", ("in_progress",), "finalizing_at",
                                         int(time.time())):
                    b.status = "finalizing"
        if b.status == "cancelling":
            await self._end(b, "cancelled")
        elif b.status == "finalizing":
            await finalize(self.store, b.id, b.tenant, "completed")
            self.owned.pop(b.id, None)

    async def _validate(self, b: OwnedBatch) -> None:
        status = await validate_batch(self.store, b.id, b.tenant, b.input_file_id, b.endpoint,
                                      self.state.sampling_defaults, self.settings.max_lines)
        if status == "failed":
            self.owned.pop(b.id, None)
        else:
            b.status = status

    async def _refill(self, b: OwnedBatch) -> None:
        rows = await self.store.pending(b.id, b.cursor, REFILL)
        queued = {ln.custom_id for ln, _ in b.waiting}
        for custom_id, line_no, body, attempt in rows:
            b.cursor = max(b.cursor, int(line_no) + 1)
            if custom_id not in b.running and custom_id not in queued:
                b.waiting.append((Line(custom_id, int(line_no), orjson.loads(body)),
                                  int(attempt)))
        if len(rows) < REFILL:
            b.exhausted = True

    async def _end(self, b: OwnedBatch, status: str) -> None:
        """Expired or cancelled: stop its running lines (aborted on their workers, billed for
        what they produced), give every line without a result its error line, end it."""
        running = [r.task for r in b.running.values() if r.task is not None]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        b.waiting.clear()
        code, message = ENDED_CODES[status]
        unfinished = await self.store.unfinished(b.id)
        await self.store.record_many(b.id, [
            (cid, int(n), True, orjson.dumps(error_line(b.id, cid, code, message)).decode())
            for cid, n in unfinished])
        await finalize(self.store, b.id, b.tenant, status)
        self.owned.pop(b.id, None)
        log.info("batch %s %s; %d lines unfinished", b.id, status, len(unfinished))

    # ---- lines ----------------------------------------------------------------------------
    def _feed(self) -> None:
        if self.closing or self.state.draining or self.state.service is None:
            return
        starting = sum(r.starting for b in self.owned.values() for r in b.running.values())
        room = idle_slots(self.state.dispatcher, self.state.queue, self.settings.idle_margin,
                          self.settings.max_queued, starting)
        now = time.monotonic()
        ready = [b for b in sorted(self.owned.values(), key=lambda b: (b.created_at, b.id))
                 if b.status == "in_progress" and b.waiting and b.paused_until <= now]
        while room > 0 and ready:
            b = ready[0]  # the oldest batch first: batches finish in order
            line, attempt = b.waiting.popleft()
            r = RunningLine(line, attempt)
            b.running[line.custom_id] = r
            r.task = asyncio.create_task(self._run_line(b, r), name=f"batch-line-{b.id}")
            room -= 1
            if not b.waiting:
                ready.pop(0)

    def _key(self, b: OwnedBatch) -> ApiKey | None:
        keys = self.state.keys
        if keys is None:
            return DEFAULT_KEY
        key = keys.by_hash(b.key_sha256)  # the batch's creator, as the key file now has it
        return None if key is None or key.revoked else key

    async def _run_line(self, b: OwnedBatch, r: RunningLine) -> None:
        line = r.line
        try:
            key = self._key(b)
            if key is None:
                body = {"error": {"message": "the API key that created this batch was revoked",
                                  "type": "authentication_error", "param": None,
                                  "code": "invalid_api_key"}}
                await self._record(b, line, 401, "", body)
                return
            try:
                status, rid, body = await run_line(
                    self.state, key, b.id, b.endpoint, line, r.attempt,
                    on_record=lambda gen: setattr(r, "gen", gen))
            except LineRetry as exc:
                await self._retry(b, r, exc)
                return
            await self._record(b, line, status, rid, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store outage: it runs again, same attempt
            if type(exc).__name__ == "UniqueViolationError":
                self._release_stale(b, r)
            else:
                log.exception("batch %s line %s: result not recorded; it runs again", b.id,
                              line.custom_id)
            b.waiting.appendleft((line, r.attempt))
            b.paused_until = time.monotonic() + RETRY_SECONDS
        finally:
            b.running.pop(line.custom_id, None)
            self.wake()

    def _release_stale(self, b: OwnedBatch, r: RunningLine) -> None:
        """The shared budget store holds a reservation under this line's id: the gateway that
        ran the line before died between reserving and settling (a settled line has no
        reservation left, SETTLE deletes it). This gateway holds the batch's lease, so nobody
        else runs the line: give that reservation back, and the line reserves again."""
        rid = engine_request_id(ENDPOINTS[b.endpoint], b.id, r.line.custom_id, r.attempt)
        log.warning("batch %s line %s: releasing the reservation its dead gateway left",
                    b.id, r.line.custom_id)
        self.state.accounting.budgets.release(Reservation(b.tenant, "", 0.0, request_id=rid))

    async def _record(self, b: OwnedBatch, line: Line, status: int, rid: str,
                      body: dict) -> None:
        entry = output_line(b.id, line.custom_id, status, rid, body)
        await self.store.record(b.id, line.custom_id, line.line_no, status != 200,
                                orjson.dumps(entry).decode())

    async def _retry(self, b: OwnedBatch, r: RunningLine, exc: LineRetry) -> None:
        if r.attempt + 1 >= MAX_ATTEMPTS:
            await self._record(b, r.line, exc.error.status, "", exc.error.body())
            return
        attempt = await self.store.bump_attempt(b.id, r.line.custom_id)
        b.waiting.appendleft((r.line, attempt))
        wait = exc.error.headers.get("Retry-After")
        b.paused_until = time.monotonic() + (float(wait) if wait else RETRY_SECONDS)

    # ---- shutdown -------------------------------------------------------------------------
    async def close(self, grace: float = 5.0) -> None:
        """Stop feeding, let running lines finish within `grace`, stop the rest (their next
        run gets a new attempt: this one was billed as cancelled for what it produced), and
        give the leases back so a restarted or other gateway resumes at once."""
        self.closing = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()  # no turn of the loop uses the store once it is closed
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = {r.task: (b, r) for b in self.owned.values() for r in b.running.values()
                 if r.task is not None}
        if tasks:
            _, late = await asyncio.wait(list(tasks), timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            for task in late:
                b, r = tasks[task]
                try:
                    await self.store.bump_attempt(b.id, r.line.custom_id)
                except Exception:  # noqa: BLE001 - a store outage: the lease expires instead
                    log.warning("batch %s line %s: attempt not raised", b.id, r.line.custom_id)
        try:
            await self.store.release(self.owner)
        except Exception:  # noqa: BLE001 - the lease expires instead
            log.warning("batch leases not released; they expire after %.0f s",
                        self.settings.lease_seconds)
        await self.store.close()


def settings_of(config: Any) -> BatchSettings:
    return BatchSettings(config.batch_max_file_bytes, config.batch_max_lines,
                         config.batch_max_open, config.batch_idle_margin,
                         config.batch_max_queued, config.batch_lease_seconds)


__all__ = ["BATCH", "ENDPOINTS", "BatchRunner", "BatchSettings", "owner_name", "settings_of"]


BATCH = web.AppKey("batch_runner", BatchRunner)  # the routes' way to the runner and its store
