"""Continuous-batching scheduler: a token budget per step, running requests first.

There is no prefill or decode phase: every request's `num_computed_tokens` catches up with its
`num_tokens`. A long prompt is cut into chunks that share a step with other requests' decodes.
When blocks run out, the least urgent running request (highest priority value, latest arrival)
is preempted: its blocks are freed and it is recomputed later from its tokens. While requests
decode, the inter-token budget (runtime/scheduling/itl_budget.py) caps each step's prefill
tokens at what fits its step-time target, so a new prompt does not stall the running streams.

The scheduler is the one place that advances requests' counters; the KV manager says what it
allocated and the scheduler turns that into computed and cached tokens. Each step's plan goes
out as a frozen `SchedulerOutput` (runtime/scheduling/output.py) holding ids and ints only.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from contract.config import EngineConfig
from runtime.kv.manager import KVCacheManager, PrefixHit
from runtime.scheduling.itl_budget import ItlBudget, PrefillAllowance
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.scheduling.request import Request, RequestStatus
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.governor import Governor
from runtime.spec_decode.ngram import propose_ngram


class WaitingQueue:
    """Heap of waiting requests ordered by (priority, arrival time)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []
        self._removed: set[str] = set()
        self._ids: set[str] = set()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, request))
        self._ids.add(request.request_id)
        self._removed.discard(request.request_id)

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[1]
        self._ids.discard(request.request_id)
        return request

    def remove(self, request: Request) -> None:
        """Lazy removal: O(1) now, skipped when it reaches the top."""
        if request.request_id in self._ids:
            self._ids.discard(request.request_id)
            self._removed.add(request.request_id)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][1].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1].request_id)

    def __len__(self) -> int:
        return len(self._ids)

    def num_tokens_to_compute(self) -> int:
        """Tokens the waiting requests have yet to compute (before any prefix-cache hit)."""
        return sum(r.num_tokens - r.num_computed_tokens for _, r in self._heap
                   if r.request_id in self._ids)


@dataclass
class _StepPlan:
    """The step being planned; frozen into a SchedulerOutput once complete."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 spec: SpecConfig | None = None, draft_cost: float = 0.0):
        self.config = config
        self.spec = spec or SpecConfig()
        self.governor = Governor(self.spec, draft_cost)
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # reported with the next step's output
        # a prompt that cannot be chunked cannot be capped either
        self.itl: ItlBudget | None = ItlBudget.from_target_ms(itl_target_ms(config)) \
            if config.enable_chunked_prefill else None

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks (abort, stop, length)."""
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        self.kv.remove(request.request_id)
        request.status = status
        self._finished_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan()
        budget = self.config.max_num_batched_tokens
        allowance = self._prefill_allowance()
        budget = self._schedule_running(plan, budget, allowance)
        if not plan.preempted:  # no room was short this step: admit waiting requests
            self._schedule_waiting(plan, budget, allowance)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(tuple(plan.scheduled), tuple(plan.preempted), finished,
                               self.kv.take_transfers())

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine timed a step it ran: the inter-token budget learns its cost."""
        if self.itl is not None and not out.is_empty:
            self.itl.observe(out, seconds)

    def _prefill_allowance(self) -> PrefillAllowance | None:
        """This step's room for prefill beside the requests decoding now (None: no cap)."""
        if self.itl is None:
            return None
        rows = attention = backlog = 0
        for r in self.running:
            runnable = self._num_runnable(r)
            if runnable > 1:
                backlog += runnable
            elif r.num_computed_tokens == r.num_tokens - 1 and not self._ends_in_flight(r) \
                    and not r.awaits_grammar:
                rows += 1
                attention += r.num_tokens  # its one row reads every position up to its own
        if rows and self.itl.paces:
            backlog += self.waiting.num_tokens_to_compute()
        return self.itl.allowance(rows, attention, backlog)

    def _schedule_running(self, plan: _StepPlan, budget: int,
                          allowance: PrefillAllowance | None = None) -> int:
        scheduled_ids: set[str] = set()
        decoding = sum(1 for r in self.running if r.num_computed_tokens == r.num_tokens - 1)
        speculate = self.governor.step_allows(decoding)
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._ends_in_flight(request):
                continue  # its last token is in the step still running: nothing to plan
            runnable = self._num_runnable(request)
            num_new = min(runnable, budget)
            # a chunk of its prompt (or of forced tokens) stays within the inter-token budget
            prefill = allowance if allowance is not None and runnable > 1 else None
            if prefill is not None:
                num_new = prefill.fit(request.num_computed_tokens, num_new)
            if num_new <= 0:
                continue
            # this step samples (a chunk cut to one token does not)
            decodes = num_new == runnable == 1 and not request.awaits_grammar
            num_spec, proposals = self._plan_spec(request, budget) if speculate and \
                decodes else (0, ())
            num_new += num_spec
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(exclude=scheduled_ids)
                self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it made room for others: its proposals are dropped with it
            if prefill is not None:
                prefill.commit(request.num_computed_tokens, num_new)
            self._add(plan, request, num_new - num_spec, num_spec, proposals)
            scheduled_ids.add(request.request_id)
            budget -= num_new
        return budget

    def _schedule_waiting(self, plan: _StepPlan, budget: int,
                          allowance: PrefillAllowance | None = None) -> None:
        deferred: list[Request] = []
        in_flight = self._prefix_blocks_in_flight()
        while budget > 0:
            request = self.waiting.peek()
            if request is None:
                break
            if len(self.running) >= self.config.max_num_seqs and \
                    not self._preempt_for(request, plan):
                break
            hit = self.kv.match_prefix(request)
            if self._next_block_in_flight(request, hit, in_flight):
                deferred.append(self.waiting.pop())  # its prefix is being computed right now
                continue
            num_new = self._num_runnable(request) - hit.num_blocks * self.kv.block_size
            if num_new <= 0:
                deferred.append(self.waiting.pop())  # its grammar is compiling: nothing to run
                continue
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            start = request.num_computed_tokens + hit.num_blocks * self.kv.block_size
            if allowance is not None:
                num_new = allowance.fit(start, num_new)
                if num_new <= 0:
                    break  # this step has no room for more prefill: keep the order
            allocation = self.kv.allocate_slots(request, num_new, hit)
            if allocation is None:
                if self._preempt_for(request, plan):
                    continue  # a less urgent request made room: look again
                break  # the most urgent waiting request does not fit: keep order, wait
            self.waiting.pop()
            self._admit(request, allocation.num_cached_tokens)
            if allowance is not None:
                allowance.commit(start, num_new)
            self._add(plan, request, num_new)
            budget -= num_new
            in_flight.update(self._pending_prompt_blocks(request))
        for request in deferred:
            self.waiting.push(request)

    def _ends_in_flight(self, request: Request) -> bool:
        """The request's last allowed token is a placeholder (runtime/execution/overlap.py): it ends
        when that step is read back, whatever the token is."""
        return request.num_placeholders > 0 and (
            request.num_output_tokens + request.num_placeholders >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len)

    @staticmethod
    def _num_runnable(request: Request) -> int:
        """Tokens the request may compute now: all it has, but the last one (whose step
        samples) waits while its grammar compiles."""
        num = request.num_tokens - request.num_computed_tokens
        return num - 1 if request.awaits_grammar else num

    def _admit(self, request: Request, num_cached: int) -> None:
        """A waiting request starts running, after the tokens the prefix cache served."""
        request.num_computed_tokens += num_cached
        if request.num_preemptions == 0:  # billing counts the first admission only
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    # ---- prefix-aware admission ---------------------------------------------------------
    def _pending_prompt_blocks(self, request: Request) -> list[bytes]:
        """Hashes of the request's full prompt blocks not computed yet."""
        if not self.kv.enable_prefix_caching or \
                request.num_computed_tokens >= request.num_prompt_tokens:
            return []
        hashes = self.kv.block_hashes_upto(request, request.num_prompt_tokens)
        return hashes[request.num_computed_tokens // self.kv.block_size:]

    def _prefix_blocks_in_flight(self) -> set[bytes]:
        pending: set[bytes] = set()
        for r in self.running:
            pending.update(self._pending_prompt_blocks(r))
        return pending

    def _next_block_in_flight(self, request: Request, hit: PrefixHit,
                              in_flight: set[bytes]) -> bool:
        """True when the first block this request would compute is being computed by a
        running request: waiting a step or two turns that recompute into a cache hit; never
        for a request that reads no cache (it gathers prompt logprobs)."""
        if not in_flight or request.needs_prompt_logprobs:
            return False
        hashes = self.kv.block_hashes_upto(request, request.num_tokens - 1)
        return hit.num_blocks < len(hashes) and hashes[hit.num_blocks] in in_flight

    def _add(self, plan: _StepPlan, request: Request, num_tokens: int, num_spec: int = 0,
             proposals: tuple[int, ...] = ()) -> None:
        """Schedule the request's next `num_tokens` tokens, then `num_spec` proposals."""
        start = request.num_computed_tokens
        end = start + num_tokens
        plan.scheduled.append(ScheduledRequest(
            request.request_id, start, tuple(request.token_slice(start, end)),
            tuple(self.kv.block_ids(request.request_id)), num_spec, proposals,
            samples=end == request.num_tokens))

    def _plan_spec(self, request: Request, budget: int) -> tuple[int, tuple[int, ...]]:
        """How many proposed tokens to verify for a decoding request this step, and the
        proposals when they are known now: n-gram lookups are made here, a model drafter
        makes its own in the runner."""
        room = min(request.params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1, budget - 1)
        k = min(self.governor.num_tokens(request), room)
        if k <= 0:
            return 0, ()
        if self.spec.method == "ngram":
            proposals = tuple(propose_ngram(
                request.prompt_token_ids + request.output_token_ids, k))
            return len(proposals), proposals
        return k, ()

    def _preempt_for(self, request: Request, plan: _StepPlan) -> bool:
        """Preempt the least urgent running request if `request` is strictly more urgent
        (by priority class, not arrival), so an urgent arrival need not wait for a slot."""
        if not self.running:
            return False
        victim = max(self.running, key=lambda r: r.sort_key)
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, plan)
        return True

    def _pick_victim(self, exclude: set[str]) -> Request:
        """Least urgent running request: highest priority value, then latest arrival.

        Requests already scheduled this step are spared unless nothing else is left.
        """
        candidates = [r for r in self.running if r.request_id not in exclude] or self.running
        return max(candidates, key=lambda r: r.sort_key)

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.push(request)
        plan.preempted.append(request.request_id)
        # drop a chunk already scheduled for it this step (only when nothing else was left)
        plan.scheduled = [s for s in plan.scheduled if s.request_id != request.request_id]

    # ---- after the model ran ----------------------------------------------------------
    def update_computed(self, out: SchedulerOutput,
                        num_rejected: dict[str, int] | None = None) -> list[Request]:
        """Advance counters (rejected proposals are not computed: their KV is dropped and
        blocks past the sequence are freed); return the requests that sampled this step."""
        running = {r.request_id: r for r in self.running}  # every scheduled one is running
        ready = []
        for s in out.scheduled:
            request = running[s.request_id]
            rejected = (num_rejected or {}).get(s.request_id, 0) if s.num_spec else 0
            request.num_computed_tokens += s.num_new_tokens - rejected
            if s.num_spec:
                self.governor.record(request.spec, s.num_spec, s.num_spec - rejected)
                self.kv.trim(request)
            self.kv.cache_full_blocks(request)
            if s.samples:
                ready.append(request)
        return ready


def itl_target_ms(config: EngineConfig) -> float | None:
    """`--itl-target-ms`: None (not given) for the automatic target, 0 for off."""
    return config.itl_target_ms
