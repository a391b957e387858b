"""How many intra-op threads the engine's steps use, chosen from how fast steps actually run.

On a small machine the worker's OpenMP threads meet at a barrier after every op. When another
process takes one of the cores (a load tester, a build, the gateway's own event loop at high
stream counts), the thread sharing that core runs in scheduler time slices and every op waits
for it: steps slow down by 3-10x instead of the 2x that losing a core should cost. One thread
fewer then runs faster than all of them. No fixed count is right for both cases, so the
governor measures: it alternates the candidate counts step by step for a short trial, keeps
the one with the lowest median seconds per row, and tries again every `explore_every` steps
or at once when the chosen count's pace drifts from what it measured (a neighbour came or went).

A trial must be cheap when the machine is busy: there, one step with every thread can take
30-50x a one-thread step (each barrier waits out a scheduler slice). So a count whose fastest
trial step is `abandon` times another count's median leaves the trial after that one step, and
a trial that keeps the count doubles the wait before the next (up to `max_backoff` times
`explore_every`); a change of count or a drift resets it. While it runs fewer threads than
cores it also watches the machine's idle cores (runtime/execution/cpu_idle.py): half a core more
idle than when it chose means a neighbour left, and a trial runs at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from contract.config import THREAD_POLICIES
from runtime.execution.cpu_idle import IdleCores


def candidates(max_threads: int) -> list[int]:
    """All of them, one fewer, and half: the counts worth comparing on a busy machine."""
    return sorted({max_threads, max(1, max_threads - 1), max(1, max_threads // 2)})


class ThreadGovernor:
    def __init__(self, max_threads: int | None = None, policy: str = "adaptive",
                 trial_steps: int = 6, explore_every: int = 400, drift: float = 1.6,
                 abandon: float = 3.0, max_backoff: int = 4,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter,
                 idle_cores: Callable[[], float] | None = None):
        if policy not in THREAD_POLICIES:
            raise ValueError(f"thread policy must be one of {', '.join(THREAD_POLICIES)}, "
                             f"not {policy!r}")
        self.max_threads = max_threads or torch.get_num_threads()
        self.options = candidates(self.max_threads) if policy == "adaptive" else \
            [self.max_threads]
        self.trial_steps = trial_steps
        self.explore_every = explore_every
        self.drift = drift
        self.abandon = abandon
        self.max_backoff = max_backoff
        self.interval = explore_every  # steps before the next periodic trial (backs off)
        self._set = set_threads
        self._clock = clock
        self.chosen = self.max_threads
        self.pace: float | None = None  # median seconds per row of the chosen count
        self._recent: list[float] = []  # the chosen count's latest paces
        self._trial: dict[int, list[float]] | None = None
        self._steps_since = 0
        self._current = 0
        self._started = 0.0
        self.trials = 0  # how many trials ran (tests, stats)
        # idle cores since the last look (None: not watched), and what they were at the choice
        if idle_cores is None and self.adaptive:
            idle_cores = IdleCores.open(self.max_threads)
        self._idle = idle_cores
        self._idle_at_choice = 0.0
        self._apply(self.chosen)

    @property
    def adaptive(self) -> bool:
        return len(self.options) > 1

    def before_step(self) -> None:
        if self.adaptive and self._trial is None and self._steps_since >= self.interval:
            self._trial = {n: [] for n in self.options}
        if self._trial is not None:
            # the count with the fewest samples next: the trial alternates them step by step
            trial = self._trial
            self._apply(min(trial, key=lambda n: len(trial[n])))
        self._started = self._clock()

    def after_step(self, rows: int) -> None:
        """Record the step just run over `rows` token rows (0: nothing ran, nothing learnt)."""
        if rows <= 0 or not self.adaptive:
            return
        pace = (self._clock() - self._started) / rows
        if self._trial is not None:
            self._trial[self._current].append(pace)
            self._drop_hopeless(self._trial)
            if all(len(v) >= self.trial_steps for v in self._trial.values()):
                self._decide()
            return
        self._steps_since += 1
        self._recent = (self._recent + [pace])[-self.trial_steps:]
        if self.pace is None:
            if len(self._recent) == self.trial_steps:  # first steps warm up; then a trial
                self._steps_since = self.interval
        elif len(self._recent) == self.trial_steps:
            now = _median(self._recent)
            if now > self.pace * self.drift or now < self.pace / self.drift \
                    or self._neighbour_left():
                self.interval = self.explore_every
                self._steps_since = self.interval

    def _neighbour_left(self) -> bool:
        """Every trial_steps steps while fewer threads run than cores: half a core more idle
        than at the choice."""
        if (self._idle is None or self.chosen >= self.max_threads
                or self._steps_since % self.trial_steps):
            return False
        return self._idle() >= self._idle_at_choice + 0.5

    def _drop_hopeless(self, trial: dict[int, list[float]]) -> None:
        """Counts whose fastest step so far is `abandon` times the best median leave the
        trial (the best count itself never does)."""
        sampled = [v for v in trial.values() if v]
        if len(sampled) < 2:
            return
        best = min(_median(v) for v in sampled)
        for n in [n for n, v in trial.items() if v and min(v) > self.abandon * best]:
            del trial[n]

    def _decide(self) -> None:
        assert self._trial is not None
        medians = {n: _median(v) for n, v in self._trial.items()}
        kept = min(medians, key=medians.__getitem__)
        self.interval = (min(self.interval * 2, self.explore_every * self.max_backoff)
                         if kept == self.chosen and self.pace is not None
                         else self.explore_every)
        self.chosen = kept
        if self._idle is not None:
            self._idle_at_choice = self._idle()
        self.pace = medians[self.chosen]
        self._trial = None
        self._recent = []
        self._steps_since = 0
        self.trials += 1
        self._apply(self.chosen)

    def _apply(self, n: int) -> None:
        if n != self._current:
            self._set(n)
            self._current = n


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]
