"""The inter-token budget: how much prefill a step may carry while requests are decoding.

A decode step that also carries a new prompt's prefill chunk lasts as long as the chunk, and
every running stream waits that long for its next token. So while requests decode, a step's
prefill tokens are capped at what the step cost model (runtime/scheduling/step_cost.py)
predicts fits a step-time target; with nothing decoding, prefill goes at full size (the token
budget alone), so an idle engine's time to first token is what it was.

`--itl-target-ms` sets the target. By default it is automatic: `AUTO_FACTOR` times the
predicted decode-only step of the batch running now, and prefill is paced rather than only
capped: each step carries at least the prompt tokens waiting (the backlog) over `PACE_STEPS`.
Why both: on a CPU a prompt token costs about what a decode row costs, so in a busy closed loop
most of the work is prefill; capped at the decode step's cost alone, prompts would queue and
their first tokens wait for seconds, and draining them in bursts instead makes the steps
bimodal (short decode steps, long catch-up steps), which is the tail this removes. Pacing the
backlog over a fixed number of steps spreads it evenly, so the steps stay alike and a prompt's
first token waits at most about `PACE_STEPS` steps longer than it would alone.

A fixed target is a promise about the gaps, so it is not paced: prefill gets what fits it, and
at least `min_chunk` tokens per step, so a waiting prompt still progresses and its time to
first token stays bounded by its length over `min_chunk` steps.
"""
from __future__ import annotations

from runtime.scheduling.output import SchedulerOutput
from runtime.scheduling.step_cost import StepCostModel, StepShape, chunk_attention

AUTO_FACTOR = 1.8  # below the 2x (p99 / median), for the model's prediction error
MIN_CHUNK = 16  # prompt tokens per step a waiting prompt always gets (one KV block by default)
PACE_STEPS = 16  # automatic target: the backlog is spread over at most this many steps


class ItlBudget:
    """The engine's inter-token budget: it learns step costs and sizes each step's prefill.

    `target_s`: a fixed step-time target in seconds, or None for the automatic one."""

    def __init__(self, target_s: float | None = None, cost: StepCostModel | None = None,
                 min_chunk: int = MIN_CHUNK, factor: float = AUTO_FACTOR,
                 pace_steps: int = PACE_STEPS):
        if target_s is not None and target_s <= 0.0:
            raise ValueError(f"the inter-token target must be positive, not {target_s} s")
        if min_chunk < 1 or factor <= 1.0 or pace_steps < 1:
            raise ValueError("min_chunk and pace_steps must be >= 1 and the factor above 1")
        self.target_s = target_s
        self.cost = cost or StepCostModel()
        self.min_chunk = min_chunk
        self.factor = factor
        self.pace_steps = pace_steps

    @classmethod
    def from_target_ms(cls, itl_target_ms: float | None) -> ItlBudget | None:
        """The budget `--itl-target-ms` asks for: 0 (the default) turns the budget off
        (prefill chunks as large as the token budget allows), None is the automatic target
        (`EngineConfig(itl_target_ms=None)`)."""
        if itl_target_ms is None:
            return cls()
        if itl_target_ms < 0:
            raise ValueError(f"--itl-target-ms must be >= 0 (0: off), not {itl_target_ms}")
        return cls(itl_target_ms / 1000.0) if itl_target_ms > 0 else None

    @property
    def paces(self) -> bool:
        """Whether each step carries at least the backlog over `pace_steps` (automatic)."""
        return self.target_s is None

    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step ran for `seconds`: learn what it cost."""
        self.cost.observe(StepShape.of(sched), seconds)

    def allowance(self, decode_rows: int, decode_attention: int,
                  backlog: int = 0) -> PrefillAllowance | None:
        """The prefill a step with these decodes may carry, with `backlog` prompt tokens
        waiting to be computed; None when nothing decodes (no cap)."""
        if decode_rows <= 0:
            return None
        floor = self.min_chunk
        if self.paces:
            floor = max(floor, -(-backlog // self.pace_steps))
        return PrefillAllowance(self, StepShape(0, decode_rows, decode_attention), floor)

    def target(self, decode_only: StepShape) -> float | None:
        """The step-time target for a step decoding `decode_only`; None while the cost model
        cannot price a step yet."""
        predicted = self.cost.predict(decode_only)
        if predicted is None:
            return None
        return self.target_s if self.target_s is not None else self.factor * predicted


class PrefillAllowance:
    """One step's room for prefill next to its decodes, handed out chunk by chunk: `fit` says
    how many tokens of a chunk fit, `commit` records what was scheduled."""

    def __init__(self, budget: ItlBudget, decodes: StepShape, floor: int):
        self.budget = budget
        self.floor = floor  # prefill tokens this step carries whatever the prediction
        self.shape = decodes  # the step so far: its decodes, then each committed chunk
        self._target: float | None = None
        self._priced = False
        self.committed = 0  # prefill tokens scheduled this step

    def fit(self, start: int, wanted: int) -> int:
        """Tokens of a chunk from position `start` (at most `wanted`) this step may carry: the
        most that keeps the predicted step within the target, and at least what is left of
        the step's floor."""
        if wanted <= 0:
            return 0
        floor = min(wanted, max(self.floor - self.committed, 0))
        target = self._step_target()
        if target is None:  # not priced yet: the pace alone, or no cap under a fixed target
            return floor if self.budget.paces else wanted
        return max(self._most_within(start, wanted, target), floor)

    def commit(self, start: int, num_tokens: int) -> None:
        s = self.shape
        self.shape = StepShape(s.prefill_tokens + num_tokens, s.decode_rows,
                               s.attention + chunk_attention(start, num_tokens))
        self.committed += num_tokens

    def _step_target(self) -> float | None:
        if not self._priced:  # priced once per step, when the first prefill asks
            self._target = self.budget.target(self.shape)
            self._priced = True
        return self._target

    def _most_within(self, start: int, wanted: int, target: float) -> int:
        """The largest n <= wanted whose step is predicted within target, by bisection (the
        prediction grows with n: every coefficient is non-negative)."""
        lo, hi = 0, wanted
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._predict_with(start, mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _predict_with(self, start: int, n: int) -> float:
        s = self.shape
        shape = StepShape(s.prefill_tokens + n, s.decode_rows,
                          s.attention + chunk_attention(start, n))
        return self.budget.cost.predict(shape) or 0.0
