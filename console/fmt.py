"""Pure text formatting for the console: money, token counts, bytes, durations, sparklines."""
from __future__ import annotations

import math
from collections.abc import Iterable

SPARK_BARS = "▁▂▃▄▅▆▇█"


def money(x: float) -> str:
    """Dollars readable at any scale: $40.3M, $12,345, $12.34, $0.123, $0.000123."""
    if math.isnan(x):
        return "—"
    sign = "-" if x < 0 else ""
    a = abs(x)
    if a == 0:
        return "$0"
    if a >= 1e9:
        return f"{sign}${a / 1e9:.1f}B"
    if a >= 1e6:
        return f"{sign}${a / 1e6:.1f}M"
    if a >= 1e4:
        return f"{sign}${a:,.0f}"
    if a >= 1:
        return f"{sign}${a:,.2f}"
    if a >= 0.01:
        return f"{sign}${a:.3f}"
    if a >= 1e-10:  # three significant digits, never an exponent: $0.0000154
        decimals = 2 - math.floor(math.log10(a))
        return f"{sign}${a:.{decimals}f}"
    return f"{sign}${a:.2e}"


def count(n: float) -> str:
    """Token or request counts: 950, 5.1k, 3.4M."""
    a = abs(n)
    if a >= 1e9:
        return f"{n / 1e9:.1f}G"
    if a >= 1e6:
        return f"{n / 1e6:.1f}M"
    if a >= 1e4:
        return f"{n / 1e3:.0f}k"
    if a >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def seconds(s: float | None) -> str:
    """A latency: 850µs, 42ms, 1.25s."""
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.0f}µs"
    if s < 1:
        return f"{s * 1e3:.0f}ms"
    return f"{s:.2f}s"


def uptime(s: float) -> str:
    s = int(max(s, 0))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s"


def sparkline(values: Iterable[float], width: int, lo: float | None = 0.0,
              hi: float | None = None) -> str:
    """The last `width` values as block characters, scaled between lo and hi (data min/max
    when None); padded on the left with spaces so the newest value is always rightmost."""
    vals = list(values)[-width:] if width > 0 else []
    if not vals:
        return " " * max(width, 0)
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    top = len(SPARK_BARS) - 1
    chars = []
    for v in vals:
        level = 0 if span <= 0 else round((min(max(v, lo), hi) - lo) / span * top)
        chars.append(SPARK_BARS[level])
    return " " * (width - len(vals)) + "".join(chars)
