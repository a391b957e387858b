"""The delay between attempts to bring a worker back (a process restarted, a connection made
again): doubling from `first` to at most `most`, and back to `first` after a success."""
from __future__ import annotations


class Backoff:
    def __init__(self, first: float = 0.5, most: float = 10.0):
        self.first, self.most = first, most
        self.delay = first

    def next(self) -> float:
        """The delay before the next attempt; the one after it is twice as long."""
        delay, self.delay = self.delay, min(self.most, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first
