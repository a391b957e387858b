"""How many tokens to propose for each request: the draft length that maximises expected
tokens per unit of work, from the request's running acceptance rate and the drafter's cost.

Per step, a request speculating k tokens with per-token acceptance r yields on average
1 + r + r^2 + ... + r^k tokens, and costs one target step, k draft steps of relative cost c
(0 for n-gram lookups, about L / layers for a self-draft) and a little verification overhead
per proposed token. When no k beats plain decoding by a margin, the request decodes normally
and probes again now and then. The whole step decodes normally when the batch is large enough
to be compute-bound, where verifying guesses costs as much as decoding them.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.spec_decode.config import SpecConfig
from runtime.structured.reasoning import grammar_waits

EMA = 0.3
VERIFY_COST = 0.05  # extra target work per proposed token at small batch (memory-bound)
MIN_GAIN = 1.1  # speculate only when expected tokens per unit of work beat this
PROBE_EVERY = 32  # steps between probes of a paused request


@dataclass
class SpecState:
    """One request's speculation record: the governor's acceptance estimate and the totals
    that end up in the request's final timing."""

    rate: float = 1.0  # running per-token acceptance (optimistic at first, so it probes)
    num_paused_steps: int = 0  # decode steps since the governor last let it speculate
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
        self.draft_cost = draft_cost  # one draft token's work relative to one target step

    def step_allows(self, num_decoding: int) -> bool:
        return self.config.enabled and num_decoding <= self.config.max_batch

    def best_k(self, rate: float) -> tuple[int, float]:
        """The draft length with the best expected tokens per unit of work, and that gain."""
        best, gain = 0, 1.0
        for k in range(1, self.config.num_tokens + 1):
            g = expected_tokens(rate, k) / (1 + k * (self.draft_cost + VERIFY_COST))
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
        if gain >= MIN_GAIN:
            state.num_paused_steps = 0
            return k
        state.num_paused_steps += 1
        return 1 if state.num_paused_steps % PROBE_EVERY == 0 else 0

    @staticmethod
    def record(state: SpecState, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        # per-token acceptance: accepting a of k in a run means about (a / k) per position
        state.rate = (1 - EMA) * state.rate + EMA * accepted / proposed
        state.num_proposed += proposed
        state.num_accepted += accepted
