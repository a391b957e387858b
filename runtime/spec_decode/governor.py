"""How many tokens to propose for each request, from its running acceptance rate.

A request starts at the configured draft length; its draft length follows an exponential
average of the fraction of proposed tokens accepted. Speculation pauses for a request whose
acceptance is low (probing again now and then) and for the whole step when the batch is large
enough to be compute-bound, where verifying guesses costs as much as decoding them.
"""
from __future__ import annotations

from runtime.spec_decode.config import SpecConfig

EMA = 0.3
LOW_ACCEPTANCE = 0.15
PROBE_EVERY = 16  # steps between probes of a paused request


class Governor:
    def __init__(self, config: SpecConfig):
        self.config = config

    def step_allows(self, num_decoding: int) -> bool:
        return self.config.enabled and num_decoding <= self.config.max_batch

    def num_tokens(self, request) -> int:
        """Draft length for this request now (0: decode normally)."""
        p = request.params
        if p.logprobs or p.top_logprobs or p.needs_penalties or not request.spec_allowed:
            return 0  # these need one distribution per step; keep them exact and simple
        state = request.spec_state
        if state["rate"] < LOW_ACCEPTANCE:
            state["paused"] += 1
            if state["paused"] % PROBE_EVERY:
                return 0
            return 1
        return max(1, min(self.config.num_tokens, round(state["rate"] * self.config.num_tokens
                                                        + 0.5)))

    @staticmethod
    def record(request, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        state = request.spec_state
        state["rate"] = (1 - EMA) * state["rate"] + EMA * accepted / proposed
        state["proposed"] += proposed
        state["accepted"] += accepted
        if state["rate"] >= LOW_ACCEPTANCE:
            state["paused"] = 0
