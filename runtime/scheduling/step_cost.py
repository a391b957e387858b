"""What an engine step costs, learned online from the engine's own step timings.

A step's seconds are modelled as `a + b * prefill_tokens + c * decode_rows + d * attention`,
where `attention` is the key positions its rows read (a chunk of n tokens from position s reads
n * s + n (n + 1) / 2 of them, a decode row at position s reads s + 1). The four coefficients
are fitted by non-negative weighted least squares over exponentially forgotten sums, so the fit
follows a machine whose pace drifts (a neighbour takes a core, the thread count changes) and one
slow step moves it only a little.

Steps fall into three kinds that excite different coefficients: decode-only (a, c), mixed (b
against c: the steps the inter-token budget has to predict) and prefill-only (a, b). Each kind
keeps its own forgotten sums, so a long run of one kind does not wash out what the others
taught: after many decode-only steps the prefill coefficient still stands. Prefill-only steps
run large chunks, past the linear layers' crossover into another kernel regime, so they are
weighted down: before the first mixed step they are the only evidence of what a prompt token
costs, after it they hardly move the fit.

Each sample is weighted by 1 / seconds^2, a fit of relative errors: a 20 ms decode step counts
as much as a 500 ms prefill, and noise on CPU steps grows with their length anyway.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from runtime.scheduling.output import SchedulerOutput

ATTENTION_UNIT = 1024.0  # key positions per feature unit, so the four columns are of like size
NUM_FEATURES = 4
DECAY = 0.9  # per sample of the same kind: about the last ten steps of each kind count
KIND_WEIGHTS = (1.0, 1.0, 0.1)  # decode-only, mixed, prefill-only (see the module docstring)
RIDGE = 1e-6  # relative to each column's scale: keeps an unexcited coefficient at zero
REFIT_EVERY = 4  # new samples before the fit is redone (a fit takes ~0.1-0.3 ms in numpy)


@dataclass(frozen=True)
class StepShape:
    """The work of one step, in the units the cost model prices."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    attention: int = 0  # key positions read by every row of the step

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepShape:
        """The shape of a planned step. A request's share is a decode when it runs one token
        of its own (plus any proposals: each verified row costs what a decode row costs), as
        the engine's step statistics count it; anything longer is prefill work."""
        prefill = decode = attention = 0
        for s in sched.scheduled:
            n = s.num_new_tokens
            if n - s.num_spec == 1:
                decode += n
            else:
                prefill += n
            attention += chunk_attention(s.start_position, n)
        return cls(prefill, decode, attention)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_rows,
                         self.attention / ATTENTION_UNIT])

    @property
    def kind(self) -> int:
        """0: decode-only, 1: mixed, 2: prefill-only (the forgotten sums each keeps)."""
        if not self.prefill_tokens:
            return 0
        return 1 if self.decode_rows else 2


def chunk_attention(start: int, num_tokens: int) -> int:
    """Key positions read by `num_tokens` rows from `start`: each row sees itself and all
    before it."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Seconds of a step from its shape: an online non-negative least-squares fit."""

    def __init__(self, decay: float = DECAY, kind_weights: tuple[float, ...] = KIND_WEIGHTS,
                 min_samples: int = 3):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), not {decay}")
        self.decay = decay
        self.kind_weights = kind_weights
        self.min_samples = min_samples
        k = NUM_FEATURES
        self._gram = np.zeros((3, k, k))  # per kind: sum of w x x^T, forgotten
        self._moment = np.zeros((3, k))  # per kind: sum of w x y
        self._counts = [0, 0, 0]  # samples seen of each kind (never forgotten)
        self._coef: np.ndarray | None = None
        self._new = 0  # samples since the last fit

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn from one step that ran `seconds` (an empty or zero-time step teaches nothing)."""
        if seconds <= 0.0 or not (shape.prefill_tokens or shape.decode_rows):
            return
        kind = shape.kind
        x = shape.features()
        w = 1.0 / (seconds * seconds)
        self._gram[kind] = self.decay * self._gram[kind] + w * np.outer(x, x)
        self._moment[kind] = self.decay * self._moment[kind] + w * seconds * x
        self._counts[kind] += 1
        self._new += 1

    @property
    def ready(self) -> bool:
        """Enough is known to price a step with decodes and prefill: some decode steps, and
        some steps that carried prefill (mixed or prefill-only)."""
        return self._counts[0] + self._counts[1] >= self.min_samples and \
            self._counts[1] + self._counts[2] > 0

    @property
    def num_samples(self) -> int:
        return sum(self._counts)

    def coefficients(self) -> tuple[float, ...] | None:
        """(a, b, c, d) in seconds, d per ATTENTION_UNIT key positions; None until ready."""
        if not self.ready:
            return None
        if self._coef is None or self._new >= REFIT_EVERY:
            self._coef = self._fit()
            self._new = 0
        return tuple(float(v) for v in self._coef)

    def predict(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of this shape; None until the model is ready."""
        coef = self.coefficients()
        if coef is None:
            return None
        return float(np.dot(coef, shape.features()))

    def _fit(self) -> np.ndarray:
        weights = np.asarray(self.kind_weights)[:, None, None]
        gram = (weights * self._gram).sum(axis=0)
        moment = (weights[:, :, 0] * self._moment).sum(axis=0)
        return nonnegative_least_squares(gram, moment)


def nonnegative_least_squares(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin over beta >= 0 of beta^T G beta - 2 beta^T m (least squares from its normal
    equations G = X^T W X, m = X^T W y). With four unknowns every support is tried: the
    optimum is the unconstrained solution on its own support, so the best feasible one of
    those is it. Columns are scaled to unit diagonal first, with a small ridge, so a feature
    that never varied gets no weight instead of a singular solve."""
    k = len(moment)
    scale = np.sqrt(np.maximum(np.diag(gram), 1e-300))
    g = gram / np.outer(scale, scale) + RIDGE * np.eye(k)
    m = moment / scale
    try:  # the usual case: the plain solution is already non-negative, so it is the optimum
        full = np.linalg.solve(g, m)
        if np.all(full >= 0.0):
            return full / scale
    except np.linalg.LinAlgError:
        pass
    best, best_value = np.zeros(k), 0.0  # beta = 0 scores 0
    for size in range(1, k):
        for support in itertools.combinations(range(k), size):
            idx = list(support)
            try:
                sol = np.linalg.solve(g[np.ix_(idx, idx)], m[idx])
            except np.linalg.LinAlgError:
                continue
            if np.any(sol < 0.0):
                continue
            value = float(sol @ g[np.ix_(idx, idx)] @ sol - 2.0 * sol @ m[idx])
            if value < best_value:
                best = np.zeros(k)
                best[idx] = sol
                best_value = value
    return best / scale
