"""Per-layer, per-expert token counts over a sliding window of the last K steps: what the
expert-parallel balancer plans a placement from.

It is fed from the model's `ExpertLoad` (runtime/models/moe.py) by its cumulative `total()`,
differenced against the total seen at the previous observation, so the window never resets the
counter that the engine's snapshot (`expert_tokens`) also reads; `push_total` takes the same
cumulative counts as plain lists (a snapshot's `expert_tokens`), `push` one step's counts.
A step here is one observation: observe once per engine step for a window of K steps, or once
every n steps for a window of K * n.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class CumulativeLoad(Protocol):
    def total(self): ...  # [layers, experts] counts since start (a torch tensor or array)


class ExpertLoadWindow:
    """The last `steps` observations' counts, int64 [steps, layers, experts], as a ring."""

    def __init__(self, layers: int, experts: int, steps: int):
        if layers <= 0 or experts <= 0 or steps <= 0:
            raise ValueError("layers, experts and steps must be positive")
        self._ring = np.zeros((steps, layers, experts), dtype=np.int64)
        self._next = 0  # ring index the next observation overwrites
        self._filled = 0
        self._last_total: np.ndarray | None = None

    @property
    def steps(self) -> int:
        """Observations the window holds now (at most its length)."""
        return self._filled

    def push(self, counts) -> None:
        """One step's counts [layers, experts] (non-negative integers)."""
        c = np.asarray(counts, dtype=np.int64)
        if c.shape != self._ring.shape[1:]:
            raise ValueError(f"counts of shape {c.shape}, expected {self._ring.shape[1:]}")
        if (c < 0).any():
            raise ValueError("token counts cannot be negative")
        self._ring[self._next] = c
        self._next = (self._next + 1) % self._ring.shape[0]
        self._filled = min(self._filled + 1, self._ring.shape[0])

    def push_total(self, total) -> None:
        """Cumulative counts since start (an `ExpertLoad.total()` or a snapshot's
        `expert_tokens`): the difference from the previous one is pushed as one step; the
        first call only sets the starting point. A total that went down (a restarted model)
        restarts the count from it."""
        t = np.asarray(total, dtype=np.int64)
        last, self._last_total = self._last_total, t.copy()
        if last is None:
            return
        if last.shape != t.shape or (t < last).any():
            return  # a new model: this total is the new starting point
        self.push(t - last)

    def observe(self, load: CumulativeLoad) -> None:
        """Read the model's `ExpertLoad` (runtime/models/moe.py) without resetting it."""
        total = load.total()
        self.push_total(total.numpy() if hasattr(total, "numpy") else total)

    def totals(self) -> np.ndarray:
        """int64 [layers, experts]: the tokens routed to each expert over the window."""
        return self._ring.sum(axis=0)
