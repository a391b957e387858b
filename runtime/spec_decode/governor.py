"""How many tokens to propose for each request: the draft length with the most expected tokens
per second, judged by what steps of that shape measured on this machine.

A request speculating k tokens with per-token acceptance r yields on average
E = 1 + r + r^2 + ... + r^k tokens per step. A step of B decoding requests yields B tokens in
T(B, B) seconds plainly; with x proposals verified in it, B + sum(E_i - 1) tokens in
T(B, B + x). Both times come from the engine's own timed steps (runtime/spec_decode/
step_times.py: T(B, B) measured, T(B, B + x) - T(B, B) fitted as F + c x over the shapes
measured), so everything a speculating step costs is in them: the proposals (n-gram lookups,
a drafter's forwards), the verification rows whatever kernel path they take, the bookkeeping.
Until a batch size has a speculating step timed, a prior stands in (each proposed token costs
VERIFY_COST of a plain step, plus the drafter's relative weights): optimistic enough to try,
and two timed steps of a shape replace it.

The scheduler asks request by request; the governor plans the step as it goes: each request
gets the k with the most expected tokens per time charged to it (`best_k`: the whole time its
proposals add to the step) if that beats its plain share by MIN_GAIN, else it decodes plainly.

A request's first verification, once speculating steps are priced, carries one proposal:
its acceptance is unknown (the estimate starts optimistic), so only one row is risked; a
request that copies reaches the full length within a few steps. A paused request probes with
one proposal now and then: every PROBE_EVERY plain steps, or as
many more as keep a probe's measured extra time under PROBE_BUDGET of the plain steps' time
(up to MAX_PROBE_EVERY), so a paused request costs at most about 1% over never speculating.
While requests speculate, every REFRESH_EVERY speculating steps of a batch size one step
decodes plainly, so the plain time they are weighed against follows the context's growth and
the machine (plain steps of requests that found no proposal count too).
The whole step decodes normally when the batch is larger than `max_batch`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.step_times import ExtraCost, StepTimes, decode_step_key, fit_extra_cost
from runtime.structured.reasoning import grammar_waits

if TYPE_CHECKING:  # (runtime.scheduling imports this module)
    from runtime.scheduling.output import SchedulerOutput

DECAY = 0.9  # per verification: the acceptance counts forget, about the last 10 count
VERIFY_COST = 0.05  # prior extra work per proposed token, until the step shape is timed
MIN_GAIN = 1.05  # speculate only when expected tokens per second beat plain decoding by this
PROBE_EVERY = 32  # the fewest plain steps between two probes of a paused request
MAX_PROBE_EVERY = 512  # the most, however dear a probe measured
PROBE_BUDGET = 0.01  # a probe's measured extra time, per plain step it is spread over
REFRESH_EVERY = 32  # speculating steps of a batch size between two timed plain steps
FIRST_PLAIN = 4  # speculating steps before a batch size's plain step is first timed


@dataclass
class SpecState:
    """One request's speculation record: the governor's acceptance estimate and the totals
    that end up in the request's final timing."""

    rate: float = 1.0  # per-token acceptance: hits / trials (optimistic at first, so it tries)
    hits: float = 1.0  # accepted proposals, forgotten by DECAY per verification
    trials: float = 1.0  # proposals the target judged (each accepted one and the first rejected)
    num_paused_steps: int = 0  # decode steps since the governor last let it speculate
    probe_every: int = PROBE_EVERY  # paused steps before its next probe (from its cost)
    num_probes: int = 0
    num_proposed: int = 0
    num_accepted: int = 0


def never_speculates(params) -> bool:
    """Requests that need one distribution per step (logprobs, penalties) or opted out: kept
    exact and simple, never given proposals."""
    return bool(params.logprobs or params.top_logprobs or params.needs_penalties
                or not params.speculative)


def expected_tokens(rate: float, k: int) -> float:
    return sum(rate ** i for i in range(k + 1))


class Governor:
    def __init__(self, config: SpecConfig, draft_cost: float = 0.0):
        self.config = config
        self.draft_cost = draft_cost  # one draft token's weights relative to the target's
        self.model_drafter = config.method not in ("off", "ngram")
        self.times = StepTimes()
        self.num_probes = 0  # probes made by paused requests (all requests)
        self._since_plain: dict[int, int] = {}  # by batch: speculating steps since a plain one
        # the step being planned: its batch, whether it times a plain step, its plain
        # seconds and fitted extra cost, and what the requests planned so far add
        self._batch = 1
        self._refresh = False
        self._plain: float | None = None
        self._extra: ExtraCost | None = None
        self._rows = 0  # proposals planned so far

    # ---- per step ---------------------------------------------------------------------
    def step_allows(self, num_decoding: int) -> bool:
        if not self.config.enabled or num_decoding > self.config.max_batch:
            return False
        batch = self._batch = max(1, num_decoding)
        self._plain = self.times.seconds((batch, batch, 0))
        self._extra = fit_extra_cost([(x, s - self._plain)
                                      for x, s in self.times.extra_rows(batch)]) \
            if self._plain is not None else None
        # a plain step is timed every REFRESH_EVERY speculating steps; while a batch size
        # has none, after FIRST_PLAIN of them (not before: the first decode steps after a
        # prompt are where copying starts), then again at once, as the median needs two
        since = self._since_plain.get(batch, 0)
        self._refresh = since >= REFRESH_EVERY or self._plain is None and \
            (since >= FIRST_PLAIN or self.times.count((batch, batch, 0)) > 0)
        self._rows = 0
        return True

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine timed a step it ran: decode-only steps price their shape."""
        key = decode_step_key(out, self.model_drafter)
        if key is None:
            return
        self.times.observe(key, seconds)
        batch, rows, _ = key
        self._since_plain[batch] = 0 if rows == batch else self._since_plain.get(batch, 0) + 1

    # ---- per request ------------------------------------------------------------------
    def relative_time(self, extra: int) -> float:
        """T(B, B + extra) / T(B, B) for the step being planned: measured, else the prior."""
        if self._plain is None or self._extra is None:  # a draft forward serves the batch
            return 1.0 + extra * (self.draft_cost + VERIFY_COST) / self._batch
        return 1.0 + self._extra.seconds(extra) / self._plain

    def best_k(self, rate: float) -> tuple[int, float]:
        """The draft length with the best expected tokens per unit of time charged to this
        request, and that over plain decoding (0 and 0.0 while a plain step is timed).

        A request's plain share of a step of B is 1 / B of it; speculating, it is charged the
        whole time its proposals add, as they slow every request of the step: tokens
        E / (1 + B (t(x + k) - t(x))) per plain share, x the proposals planned before it. When
        every request clears MIN_GAIN so does the whole step, whose relative time is
        t(sum of the k). With one stream this is E / t(k)."""
        if self._refresh:
            return 0, 0.0
        batch, rows = self._batch, self._rows
        before = self.relative_time(rows)
        best, gain = 0, 1.0
        for k in range(1, self.config.num_tokens + 1):
            charged = 1.0 + batch * (self.relative_time(rows + k) - before)
            g = expected_tokens(rate, k) / charged
            if g > gain:
                best, gain = k, g
        return best, gain

    def num_tokens(self, request) -> int:
        """Draft length for this request now (0: decode normally)."""
        if never_speculates(request.params):
            return 0
        if grammar_waits(request):  # no mask yet for proposals past the thought's end
            return 0
        state = request.spec
        k, gain = self.best_k(state.rate)
        if self._refresh and k == 0:
            return 0  # a timed plain step, not a pause
        if k and gain >= MIN_GAIN:
            state.num_paused_steps = 0
            if not state.num_proposed and self._extra is not None:
                k = 1  # its first verification: the optimistic start risks one row, not k
            self._rows += k
            return k
        state.num_paused_steps += 1
        if state.num_paused_steps < state.probe_every:
            return 0
        state.num_paused_steps = 0
        state.probe_every = self._probe_interval()
        state.num_probes += 1
        self.num_probes += 1
        self._rows += 1
        return 1

    def _probe_interval(self) -> int:
        """Plain steps a probe is spread over so that it costs under PROBE_BUDGET of their
        time: its measured extra time (one proposal over a plain step) / the budget, within
        [PROBE_EVERY, MAX_PROBE_EVERY]. A failed probe is not itself a reason to wait
        longer: one proposal's rejection says little about the acceptance, and its cost is
        what the budget bounds."""
        if self._extra is None:
            return PROBE_EVERY
        extra = self.relative_time(1) - 1.0
        return min(MAX_PROBE_EVERY, max(PROBE_EVERY, math.ceil(extra / PROBE_BUDGET)))

    @staticmethod
    def record(state: SpecState, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        # the target judged the accepted run and its first rejection; proposals after that
        # were never compared, so they say nothing about the per-token rate (a / k would
        # count them as failures and price a long draft's acceptance too low)
        state.hits = DECAY * state.hits + accepted
        state.trials = DECAY * state.trials + accepted + (accepted < proposed)
        state.rate = state.hits / state.trials
        state.num_proposed += proposed
        state.num_accepted += accepted
