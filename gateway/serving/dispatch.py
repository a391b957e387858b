"""Dispatch: hand queued jobs to workers that have room, keeping prefix affinity.

A worker has room for a job while it has free request slots and KV blocks for the prompt.
Among workers with room, the eligible ones are those no busier than the least loaded plus
`affinity_margin` (load: the fraction of request slots in use; with disaggregation, prompt
tokens in flight as a fraction of the KV capacity). Cache-aware routing: the job
goes to the eligible worker whose prefix cache holds the longest run of the prompt's leading
blocks, as its KV events report them (gateway/workers/prefix_index.py; ties to the less
loaded). A worker holding more of the prefix but busier than that margin is passed over: a
prefix saved is not worth queueing behind a clearly fuller worker. When no eligible worker
holds even the first block, the job goes where its prefix hashes to (rendezvous hashing of the
salt and the prompt's first tokens) if that worker is eligible, else to the least loaded: so
identical new prefixes still meet before any worker has reported caching them. When no worker
has room, a job more urgent than the least urgent request on some worker is sent there anyway:
the worker's scheduler preempts that request, which resumes later with its output unchanged.
Batch lines (gateway/batch/) run in the least urgent class, so any online job preempts them
this way, and they never preempt anything: they take only free room.
A draining worker (`draining`, gateway/serving/worker_pool.py) is given nothing new, not even
by preemption: its running requests finish and it leaves the pool.

A tenant's share of the running batch: each tenant may hold at most `max_running_share` (its
key file's, else the gateway's `tenant_max_running_share`) of the fleet's request slots while
another tenant's request waits. Fair share orders the queue only; without a cap, a tenant
that filled every slot would make another tenant's first request wait for one of its requests
to finish. Two mechanisms, both work-conserving (a tenant alone may use the whole batch):
- passing over: a tenant at its cap has its entries passed over (they keep their places) for
  the first entry of a tenant under its cap; when every waiting tenant is at its cap, the
  first in line goes. The queue keeps one line per tenant, so this costs a look per tenant at
  its cap (few: each holds a share of the slots), never a scan of the queue.
- preemption for a share: when no worker has room, a job of a tenant under its cap goes to the
  worker where tenants over their caps run the most, one priority class more urgent there than
  its own, so that worker's scheduler preempts its least urgent, latest request (which resumes
  later with its output unchanged) and the job starts within a step. Only requests of the
  job's class or less urgent are preempted, at most `max_num_seqs` wait on a worker that way,
  and a tenant's preempting jobs stop at its cap. The tenant over its cap keeps its count until
  its requests end, so it is passed over until it is back under.
Running sequences are counted per tenant by the in-flight table (`InFlightTable.slots`), from
dispatch until the bill settles. With disaggregation only the passing over applies.

With prefill/decode disaggregation (`decode_workers` given), dispatch has two stages: a job
goes to a prefill worker (prefix affinity among those with the least prompt tokens in
flight), which computes the prompt's KV and streams the first token; then `handoff` moves
each request to the decode worker with the least KV in use and fewest running requests,
telling both at once to move the KV blocks (runtime/transport/disagg.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time

from contract.frames import AbortRequest, ExportKV, ImportKV, KvEvents, Output
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase
from gateway.serving.queue import QueueEntry, QueueFull, RequestQueue
from gateway.telemetry.metrics import WorkerSeconds
from gateway.workers.handle import WorkerDied, WorkerHandle
from gateway.workers.prefix_index import PrefixHashes, PrefixIndex, cache_model_id

log = logging.getLogger(__name__)
LOOP_TICK_SECONDS = 0.05
DEFAULT_RUNNING_SHARE = 0.5  # of the fleet's slots, per tenant: two tenants get half each


class DispatchFailed(Exception):
    """Submitting one job failed for a reason of its own (a frame that cannot be encoded, a
    bug): that job fails with a 500; the dispatcher and every other job go on."""


def rendezvous_score(key: bytes, worker_index: int) -> bytes:
    return hashlib.blake2b(key + worker_index.to_bytes(4, "little"), digest_size=8).digest()


class Dispatcher:
    def __init__(self, workers: list[WorkerHandle], queue: RequestQueue, table: InFlightTable,
                 affinity_margin: float = 0.25,
                 decode_workers: list[WorkerHandle] | None = None, prefix_routing: bool = True,
                 tenant_max_running_share: float = DEFAULT_RUNNING_SHARE):
        self.workers = workers  # with disaggregation: the prefill workers
        self.queue = queue
        self.table = table
        self.affinity_margin = affinity_margin
        self.prefix_routing = prefix_routing  # False: hashing alone (the measured baseline)
        self.prefix_index = PrefixIndex()
        self._wake = asyncio.Event()
        self.decode_workers = decode_workers or []
        self.pending_handoffs: list[tuple[WorkerHandle, Output]] = []
        self._tags = itertools.count(1)
        self.last_tick = time.monotonic()  # the loop's heartbeat, for liveness checks
        self.loop_errors = 0  # exceptions the loop caught and survived
        self.draining: set[int] = set()  # worker indices given no new requests
        self.worker_time = WorkerSeconds(len(self.workers) + len(self.decode_workers))
        self.tenant_max_running_share = tenant_max_running_share  # a tenant's default cap
        self._shares: dict[str, float | None] = {}  # tenant -> its key file's share, if any

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode_workers)

    def kv_capacity_tokens(self) -> int:
        """The most tokens (prompt plus max_tokens) one request can hold on any ready worker
        that takes new requests (with disaggregation, the prefill workers, which get its
        AddRequest), from their Ready frames; 0 when none has said, leaving it to the workers."""
        return max((w.kv_capacity_tokens for w in self.workers
                    if w.alive and w.index not in self.draining), default=0)

    # ---- admission ----------------------------------------------------------------------
    def enqueue(self, job: InFlightRequest, virtual_start: float | None = None) -> None:
        """Queue a job (raises QueueFull); the dispatcher assigns it when a worker has room."""
        job.entry = QueueEntry(job.request_id, job.priority, job, virtual_start=virtual_start,
                               tenant=job.tenant, batch=job.tier == "batch")
        self._shares[job.tenant] = job.running_share  # the latest key file's, after a SIGHUP
        displaced = self.queue.push(job.entry)
        if displaced is not None and not displaced.payload.assigned.done():
            # a more urgent job took its place: it is refused as if the queue had been full
            displaced.payload.assigned.set_exception(QueueFull(self.queue.retry_after()))
        self.dispatch_ready()  # at once when a worker has room: no wait for the loop's turn

    def cancel(self, job: InFlightRequest) -> bool:
        """The client left: drop the job from the queue (True), or abort it on its worker
        (False: the worker's final outputs still arrive and are billed)."""
        if job.entry is not None and self.queue.remove(job.entry):
            job.entry = None  # record and entry point at each other: freed without the GC
            if not job.assigned.done():
                job.assigned.cancel()
            return True
        if self.disaggregated:
            for sub_id in job.sub_ids:  # wherever it is now: prefill or decode side
                for w in self.workers + self.decode_workers:
                    w.abort(sub_id)
            return False
        if job.worker is not None:
            for sub_id in job.sub_ids:
                job.worker.abort(sub_id)
        return False

    def notify(self) -> None:
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch whenever woken, and every tick. Nothing one job does can end this loop:
        `dispatch_ready` fails a bad job on its own; anything else is logged and survived."""
        while not stop.is_set():
            self.last_tick = time.monotonic()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=LOOP_TICK_SECONDS)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.dispatch_ready()
            except Exception:  # noqa: BLE001 - a dead dispatcher strands every queued job
                self.loop_errors += 1
                log.exception("dispatch round failed; the dispatcher goes on")

    def is_alive(self, stale_seconds: float = 2.0) -> bool:
        """The loop has ticked recently (it ticks every LOOP_TICK_SECONDS)."""
        return time.monotonic() - self.last_tick < stale_seconds

    def dispatch_ready(self) -> int:
        """Assign as many queued jobs, in order (tenants at their cap passed over), as the
        workers can take now."""
        assigned = 0
        if self.pending_handoffs:
            pending, self.pending_handoffs = self.pending_handoffs, []
            for prefill, out in pending:
                self.handoff(prefill, out)
        slots, capped = self.fleet_slots(), set[str]()
        while (entry := self._next_entry(slots, capped)) is not None:
            job: InFlightRequest = entry.payload
            worker_priority = None
            try:
                worker = self.choose(job) or self.choose_by_preemption(job)
                if worker is None and (worker := self.choose_for_share(job, slots)):
                    worker_priority = job.priority - 1  # see choose_for_share
            except Exception as exc:  # noqa: BLE001 - this job's own fault, not the queue's
                self.queue.pop(entry)
                self._fail(job, exc)
                continue
            if worker is None:
                break
            self.queue.pop(entry)
            self._submit(job, worker, worker_priority)
            assigned += 1
        return assigned

    def _next_entry(self, slots: int, capped: set[str]) -> QueueEntry | None:
        """The first entry whose tenant is under its cap, passing over (and adding to
        `capped`, kept for the round: counts only grow within it) the tenants at theirs;
        when every waiting tenant is at its cap, the first in line (work-conserving)."""
        while (entry := self.queue.peek(capped)) is not None:
            if not self.at_cap(entry.tenant, slots):
                return entry
            capped.add(entry.tenant)
        return self.queue.peek()

    def _submit(self, job: InFlightRequest, worker: WorkerHandle,
                worker_priority: int | None = None) -> None:
        """Send every sub-request of the job, or none: the worker encodes all frames before it
        counts anything as in flight. Never raises; a failure fails this job alone. The
        worker's placement keeps the job's own priority whatever `worker_priority` it runs
        at, so preemption by class (`choose_by_preemption`) still compares real classes."""
        try:
            worker.submit(job.add_messages(self.disaggregated, worker_priority), job.stream,
                          job.priority, len(job.prompt))
        except Exception as exc:  # noqa: BLE001 - see _fail
            self._fail(job, exc)
            return
        job.worker, job.dispatched_at = worker, time.monotonic()
        self.table.move(job, Phase.DISPATCHED)
        if not job.assigned.done():
            job.assigned.set_result(worker)

    # ---- a tenant's share of the running batch ---------------------------------------------
    def fleet_slots(self) -> int:
        """Request slots of the workers that take new requests."""
        return sum(w.max_num_seqs for w in self.workers
                   if w.alive and w.index not in self.draining)

    def cap_of(self, tenant: str, slots: int) -> int:
        """The most sequences `tenant` may run while another tenant waits (at least one)."""
        share = self._shares.get(tenant)
        share = self.tenant_max_running_share if share is None else share
        return max(1, math.floor(share * slots + 1e-9))

    def at_cap(self, tenant: str, slots: int) -> bool:
        return self.table.slots.total[tenant] >= self.cap_of(tenant, slots)

    def choose_for_share(self, job: InFlightRequest, slots: int) -> WorkerHandle | None:
        """No worker has room: the worker where tenants over their caps run the most, if the
        job's tenant is under its own and the worker runs nothing more urgent than the job
        (its least urgent class is the job's or less urgent: a bulk job never preempts an
        interactive one). The job runs there one class more urgent than its own, so the
        worker's scheduler preempts its least urgent, latest request for it."""
        if self.disaggregated or job.tier == "batch" or self.at_cap(job.tenant, slots):
            return None  # a batch line takes only free room: it never preempts
        best, most = None, 0
        for w in self.workers:
            least = w.least_urgent_priority() if w.alive and w.index not in self.draining \
                else None
            if least is None or least < job.priority or w.num_inflight >= 2 * w.max_num_seqs:
                continue  # nothing preemptible there, or max_num_seqs preempted already wait
            over = sum(k for t, k in self.table.slots.on.get(w.index, {}).items()
                       if t != job.tenant and self.table.slots.total[t] > self.cap_of(t, slots))
            if over > most:
                best, most = w, over
        return best

    def _fail(self, job: InFlightRequest, exc: Exception) -> None:
        """The job's waiter gets the error (the service then settles its bill as an error)."""
        if isinstance(exc, (WorkerDied, ConnectionError)):
            error: Exception = WorkerDied(str(exc))
        else:
            log.exception("request %s could not be dispatched", job.request_id, exc_info=exc)
            error = DispatchFailed(f"the request could not be sent to a worker: "
                                   f"{type(exc).__name__}")
        if not job.assigned.done():
            job.assigned.set_exception(error)

    # ---- placement ----------------------------------------------------------------------
    def load_of(self, worker: WorkerHandle) -> float:
        return worker.prefill_load if self.disaggregated else worker.load

    def has_room(self, worker: WorkerHandle, job: InFlightRequest) -> bool:
        return (worker.alive and worker.index not in self.draining
                and worker.free_slots >= job.n
                and worker.free_blocks >= worker.blocks_for(len(job.prompt)))

    def choose(self, job: InFlightRequest) -> WorkerHandle | None:
        candidates = [w for w in self.workers if self.has_room(w, job)]
        if not candidates:
            return None
        least = min(candidates, key=lambda w: (self.load_of(w), w.index))
        bound = self.load_of(least) + self.affinity_margin
        eligible = [w for w in candidates if self.load_of(w) <= bound]
        if self.prefix_routing:
            holder = self.longest_prefix(job, eligible)
            if holder is not None:
                return holder
        key = job.affinity_key()
        preferred = max(candidates, key=lambda w: rendezvous_score(key, w.index))
        return preferred if self.load_of(preferred) <= bound else least

    def longest_prefix(self, job: InFlightRequest, workers: list[WorkerHandle]
                       ) -> WorkerHandle | None:
        """The worker holding the most leading blocks of the job's prompt (the less loaded
        of equals); None when none holds the first block."""
        self.prefix_index.retain({w.index: w.pid for w in self.workers if w.alive})
        hashes = PrefixHashes(job.prompt, job.salt)
        best, best_tokens = None, 0
        for w in sorted(workers, key=lambda w: (self.load_of(w), w.index)):
            chain = hashes.chain(cache_model_id(w.info), w.block_size)
            tokens = self.prefix_index.cached_blocks(w.index, w.pid, chain) * w.block_size
            if tokens > best_tokens:
                best, best_tokens = w, tokens
        return best

    def on_kv_events(self, worker: WorkerHandle, frame: KvEvents) -> None:
        """A worker's KV events, forwarded by the gateway's WorkerEvents listener. Only the
        workers jobs are placed on are indexed (with disaggregation: the prefill workers)."""
        if any(w is worker for w in self.workers):
            self.prefix_index.apply(worker.index, frame, worker.pid)

    # ---- disaggregation: the second stage -------------------------------------------------
    def choose_decode(self, num_tokens: int) -> WorkerHandle | None:
        candidates = [w for w in self.decode_workers if w.alive and w.free_slots >= 1
                      and w.free_blocks >= w.blocks_for(num_tokens)]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.kv_usage, w.num_inflight, w.index))

    def handoff(self, prefill: WorkerHandle, out: Output) -> None:
        """A prefill worker has a request's prompt KV and first token: move the request to a
        decode worker (or wait for one with room; the prefill worker holds the blocks)."""
        sub_id = out["id"]
        job = self.table.get(sub_id)
        placed = prefill.inflight.get(sub_id)
        if job is None or placed is None or not prefill.alive:
            return  # cancelled or lost meanwhile; the prefill side has freed it
        decode = self.choose_decode(len(job.prompt) + 1)
        if decode is None:  # all full, or restarting: retried on every dispatch round
            self.pending_handoffs.append((prefill, out))
            return
        params = job.sub_params(job.choice_of(sub_id))
        usage = out.get("usage") or [len(job.prompt), 0, 0]
        key, tag = f"{prefill.pid}-{decode.pid}", next(self._tags) % (1 << 19)
        prefill.release(sub_id)
        decode.adopt(sub_id, placed.stream, job.priority, len(job.prompt))
        try:
            decode.send_message(ImportKV(sub_id, job.prompt, out["tokens"], params, key, tag,
                                         job.priority, job.salt, usage[1], out["prefilled"]))
            prefill.send_message(ExportKV(sub_id, key, tag))
        except (WorkerDied, ConnectionError) as exc:
            decode.release(sub_id)
            placed.stream.put_nowait(WorkerDied(str(exc), sub_id))
            if prefill.alive:
                prefill.send_message(AbortRequest(sub_id))

    def choose_by_preemption(self, job: InFlightRequest) -> WorkerHandle | None:
        """A worker running something strictly less urgent than this job, if any: a batch
        line (the least urgent class) for any online job; a batch line itself never preempts."""
        if job.tier == "batch":
            return None
        best, best_priority = None, job.priority
        for w in self.workers:
            p = w.least_urgent_priority() if w.alive and w.index not in self.draining \
                else None
            if p is not None and p > best_priority:
                best, best_priority = w, p
        return best
