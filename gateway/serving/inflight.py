"""A request in flight: one record from admission to its ledger row, in one table.

The record holds everything the gateway knows of one API request: what to run, where it is,
what it produced and what it costs. Its phase moves only through `InFlightTable.move`, along

    (admitted) -> queued -> dispatched -> streaming -> settling -> done
                     \\__________\\____________\\________/

(any phase before settling may settle at once: refused, cancelled, lost). Settling means the
bill is final and its ledger row is on its way; done means the row is committed (or there is
none to write). The table also maps each engine request id (one per choice) to its record,
which is how worker outputs find their request, and counts the sequences each tenant runs,
which the dispatcher's per-tenant share of the running batch reads.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from contract.frames import AddRequest
from contract.sampling_params import SamplingParams, choice_seed
from gateway.openai.requests import GenerationRequest
from gateway.workers.output_stream import OutputStream

if TYPE_CHECKING:  # the accounting and the queue hold records themselves
    from gateway.serving.accounting import Charge
    from gateway.serving.queue import QueueEntry
    from gateway.workers.handle import WorkerHandle

AFFINITY_TOKENS = 64


class Phase(str, Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    STREAMING = "streaming"
    SETTLING = "settling"
    DONE = "done"


NEXT: dict[Phase | None, tuple[Phase, ...]] = {
    None: (Phase.QUEUED, Phase.SETTLING),
    Phase.QUEUED: (Phase.DISPATCHED, Phase.SETTLING),
    Phase.DISPATCHED: (Phase.STREAMING, Phase.SETTLING),
    Phase.STREAMING: (Phase.SETTLING,),
    Phase.SETTLING: (Phase.DONE,),
    Phase.DONE: (),
}


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class InFlightRequest:
    """One API request: `n` engine requests (its choices) that run on the same worker."""

    # what to run, fixed at admission
    request_id: str
    request: GenerationRequest
    prompt: list[int]
    prompt_text: str
    params: SamplingParams  # built once, after tokenization fixed the output budget
    priority: int
    salt: str | None
    stream: OutputStream = field(default_factory=OutputStream)  # outputs of every choice
    model_name: str | None = None
    trace_headers: dict | None = None  # the client's traceparent / tracestate
    # "online", or "batch": a line of a Batch API job, run only in idle capacity and billed
    # at the price book's batch multiplier; `batch_id` names its batch
    tier: str = "online"
    batch_id: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # where it is
    phase: Phase | None = None  # None: admitted, not yet queued
    entry: QueueEntry | None = None  # while queued
    worker: WorkerHandle | None = None  # once dispatched
    assigned: asyncio.Future = field(default_factory=_future)  # resolves with the worker
    # when (monotonic)
    enqueued_at: float = 0.0
    dispatched_at: float | None = None
    first_token_at: float | None = None  # its first token reached the gateway
    settled_at: float | None = None
    # what it produced, kept by the accounting from the worker's outputs
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # of those, a reasoning model's thought's (counted where the answer is split, as its
    # usage reports them: gateway/openai/reasoning.py)
    reasoning_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> reason
    worker_timing: dict | None = None  # wall-clock times reported by the worker
    # money
    charge: Charge | None = None  # once admitted
    committed: asyncio.Future | None = None  # the ledger row is committed

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def sub_ids(self) -> list[str]:
        """The engine request id of each choice."""
        return [self.request_id] if self.n == 1 else [f"{self.request_id}/{i}"
                                                      for i in range(self.n)]

    def choice_of(self, sub_id: str) -> int:
        return 0 if self.n == 1 else int(sub_id.rsplit("/", 1)[1])

    def sub_params(self, i: int) -> SamplingParams:
        """Sampling parameters of choice i: the request's own, except that a seeded request
        with several choices gives each its own seed (n distinct, reproducible samples)."""
        params = self.params
        if params.seed is None or self.n == 1:
            return params
        return dataclasses.replace(params, seed=choice_seed(params.seed, i))

    @property
    def tenant(self) -> str:
        """Whose request it is ("" before admission charged it: tests, the fleet simulator)."""
        return self.charge.key.tenant.name if self.charge is not None else ""

    @property
    def running_share(self) -> float | None:
        """Its tenant's cap on the running batch, from the key file (None: the gateway's)."""
        return self.charge.key.tenant.max_running_share if self.charge is not None else None

    def add_messages(self, prefill_only: bool = False,
                     worker_priority: int | None = None) -> list[AddRequest]:
        """The worker's "add" frame of every choice; `worker_priority` replaces the request's
        priority on the worker only (the dispatcher's preemption for a tenant's share)."""
        priority = self.priority if worker_priority is None else worker_priority
        return [AddRequest(sub_id, self.prompt, self.sub_params(i), priority, self.salt,
                           prefill_only) for i, sub_id in enumerate(self.sub_ids)]

    def affinity_key(self) -> bytes:
        head = ",".join(map(str, self.prompt[:AFFINITY_TOKENS]))
        return hashlib.blake2b(f"{self.salt}|{head}".encode(), digest_size=8).digest()

    @property
    def queue_seconds(self) -> float:
        end = self.dispatched_at or time.monotonic()
        return max(0.0, end - self.enqueued_at)


class IllegalTransition(Exception):
    pass


class TenantSlots:
    """Sequences (choices) each tenant has on workers, from dispatch until its bill settles,
    on the whole fleet and per worker: O(1) reads for the dispatcher's per-tenant cap. A
    tenant with none has no key, so the maps hold only tenants running something."""

    def __init__(self) -> None:
        self.total: Counter = Counter()  # tenant -> sequences
        self.on: dict[int, Counter] = defaultdict(Counter)  # worker index -> tenant -> seqs

    def hold(self, rec: InFlightRequest) -> None:
        self.total[rec.tenant] += rec.n
        if rec.worker is not None:
            self.on[rec.worker.index][rec.tenant] += rec.n

    def release(self, rec: InFlightRequest) -> None:
        _take(self.total, rec.tenant, rec.n)
        if rec.worker is not None and rec.worker.index in self.on:
            on = self.on[rec.worker.index]
            _take(on, rec.tenant, rec.n)
            if not on:
                del self.on[rec.worker.index]


def _take(counts: Counter, key: str, n: int) -> None:
    counts[key] -= n
    if counts[key] <= 0:
        del counts[key]


class InFlightTable:
    """Every request in flight, by engine request id, with the count in each phase and the
    sequences each tenant runs (`slots`)."""

    def __init__(self):
        self._by_engine_id: dict[str, InFlightRequest] = {}
        self.phases: Counter = Counter()
        self.slots = TenantSlots()

    def move(self, rec: InFlightRequest, phase: Phase) -> None:
        """The one way a request changes phase (IllegalTransition if `NEXT` forbids it)."""
        if phase not in NEXT[rec.phase]:
            raise IllegalTransition(f"{rec.request_id}: {rec.phase} -> {phase.value}")
        if rec.phase is None:
            for sub_id in rec.sub_ids:
                self._by_engine_id[sub_id] = rec
        else:
            self.phases[rec.phase] -= 1
        if phase is Phase.DISPATCHED:
            self.slots.hold(rec)
        elif phase is Phase.SETTLING and rec.phase in (Phase.DISPATCHED, Phase.STREAMING):
            self.slots.release(rec)  # ended, on its worker or lost with it
        if phase is Phase.SETTLING:  # its outputs are all in: nothing more to route
            for sub_id in rec.sub_ids:
                self._by_engine_id.pop(sub_id, None)
        rec.phase = phase
        if phase is not Phase.DONE:
            self.phases[phase] += 1

    def get(self, engine_id: str) -> InFlightRequest | None:
        return self._by_engine_id.get(engine_id)

    def count(self, *phases: Phase) -> int:
        return sum(self.phases[p] for p in phases)

    @property
    def open(self) -> int:
        """Requests admitted and not yet settled."""
        return self.count(Phase.QUEUED, Phase.DISPATCHED, Phase.STREAMING)
