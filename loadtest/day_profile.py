"""A day-shaped arrival rate: a curve of (hour, fraction) points over 24 hours, compressed into
`day_seconds`, between `rate_min` (fraction 0) and `rate_max` (fraction 1).

Arrivals are a Poisson process whose rate follows the curve (linear between points, wrapping
past midnight), drawn by thinning: candidates at `rate_max`, each kept with probability
rate(t) / rate_max. The schedule is fixed by the seed, as the other arrival processes.

A curve file has one point a line, `HOUR FRACTION` or `HOUR,FRACTION` (hour 0 to 24,
fraction 0 to 1; `#` starts a comment), e.g. a quiet night and a busy afternoon:

    0 0.1
    9 0.6
    15 1.0
    21 0.4
"""
from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from dataclasses import dataclass

# a working day as traffic follows it: a night trough, a morning ramp, an afternoon peak
DEFAULT_CURVE = ((0.0, 0.15), (4.0, 0.0), (8.0, 0.45), (11.0, 0.85), (14.0, 1.0),
                 (18.0, 0.8), (21.0, 0.45), (24.0, 0.15))


class CurveError(ValueError):
    pass


@dataclass(frozen=True)
class DayProfile:
    rate_min: float  # requests per second at fraction 0
    rate_max: float  # at fraction 1
    day_seconds: float = 240.0  # one compressed day
    points: tuple[tuple[float, float], ...] = DEFAULT_CURVE

    def __post_init__(self) -> None:
        if not 0 <= self.rate_min <= self.rate_max or self.rate_max <= 0:
            raise CurveError(f"need 0 <= rate-min <= rate-max and rate-max > 0, got "
                             f"{self.rate_min} and {self.rate_max}")
        if self.day_seconds <= 0:
            raise CurveError(f"day-seconds must be positive, got {self.day_seconds}")
        check_points(self.points)

    def fraction(self, hour: float) -> float:
        """The curve at `hour` (any real: taken modulo 24), linear between points."""
        hour %= 24.0
        pts = closed(self.points)
        i = bisect.bisect_right([h for h, _ in pts], hour)
        (h0, f0), (h1, f1) = pts[i - 1], pts[min(i, len(pts) - 1)]
        return f0 if h1 == h0 else f0 + (f1 - f0) * (hour - h0) / (h1 - h0)

    def rate(self, t: float) -> float:
        """Requests per second `t` seconds into the run."""
        f = self.fraction(24.0 * t / self.day_seconds)
        return self.rate_min + (self.rate_max - self.rate_min) * f

    def expected(self, start: float, end: float, steps: int = 1000) -> float:
        """Requests the curve expects between two times (the integral of the rate)."""
        width = (end - start) / steps
        return sum(self.rate(start + (i + 0.5) * width) for i in range(steps)) * width

    def arrival_times(self, seed: int) -> Iterator[float]:
        rng = random.Random(seed ^ 0xDA7)
        t = 0.0
        while True:
            t += rng.expovariate(self.rate_max)
            if rng.random() * self.rate_max < self.rate(t):
                yield t


def closed(points: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """The points with the curve's ends joined across midnight (hour 0 and hour 24)."""
    pts = sorted(points)
    first, last = pts[0], pts[-1]
    span = first[0] + 24.0 - last[0]
    if span <= 0:
        return pts
    at_midnight = last[1] + (first[1] - last[1]) * (24.0 - last[0]) / span
    if first[0] > 0:
        pts.insert(0, (0.0, at_midnight))
    if last[0] < 24:
        pts.append((24.0, at_midnight))
    return pts


def check_points(points: tuple[tuple[float, float], ...]) -> None:
    if not points:
        raise CurveError("a day curve needs at least one (hour, fraction) point")
    for hour, fraction in points:
        if not 0 <= hour <= 24:
            raise CurveError(f"hour {hour} is outside 0..24")
        if not 0 <= fraction <= 1:
            raise CurveError(f"fraction {fraction} at hour {hour} is outside 0..1")
    hours = [h for h, _ in points]
    if len(set(hours)) != len(hours):
        raise CurveError("a day curve names an hour twice")


def read_curve(path: str) -> tuple[tuple[float, float], ...]:
    """(hour, fraction) points from a curve file (see the module's notes)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise CurveError(f"{path}: {exc}") from None
    points = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].replace(",", " ").split()
        if not text:
            continue
        try:
            hour, fraction = (float(v) for v in text)
        except ValueError:
            raise CurveError(f"{path}:{n}: expected 'HOUR FRACTION', got {line!r}") from None
        points.append((hour, fraction))
    result = tuple(points)
    try:
        check_points(result)
    except CurveError as exc:
        raise CurveError(f"{path}: {exc}") from None
    return result
