"""How many of the machine's cores sat idle since the last look, from /proc/stat.

The thread governor asks it while it runs fewer threads than cores: when at least half a core
more is idle than when it chose that count, a neighbour has left and the full count is worth
a trial now rather than at the next periodic one (the one-thread pace barely changes when a
neighbour goes, so pace alone cannot tell).
"""
from __future__ import annotations

from pathlib import Path

STAT = Path("/proc/stat")


def _counters(path: Path) -> tuple[int, int] | None:
    """(idle jiffies, all jiffies) over every core, or None where the file cannot be read."""
    try:
        first = path.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 5:
        return None
    values = [int(v) for v in first[1:]]
    return values[3] + values[4], sum(values[:8])  # idle + iowait; user..steal


class IdleCores:
    """Callable: the average number of idle cores since the previous call (the first call
    counts since the reader was made)."""

    def __init__(self, cores: int, path: Path = STAT):
        self.cores = cores
        self.path = path
        self._last = _counters(path) or (0, 0)

    @classmethod
    def open(cls, cores: int, path: Path = STAT) -> IdleCores | None:
        """A reader, or None where the machine has no readable /proc/stat."""
        return cls(cores, path) if _counters(path) is not None else None

    def __call__(self) -> float:
        now = _counters(self.path)
        if now is None:
            return 0.0
        idle, total = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return self.cores * idle / total if total > 0 else 0.0
