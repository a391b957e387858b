"""`--compare A.json B.json`: the headline figures of two results side by side, with B - A
and B / A. Rows are (label, path into the result document)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from loadtest.result import read_result
from loadtest.tables import add_row, new_table, show

ROWS = [
    ("requests ok", ("summary", "requests", "completed")),
    ("requests failed", ("summary", "requests", "failed")),
    ("req/s", ("summary", "throughput", "requests_per_s")),
    ("output tok/s", ("summary", "throughput", "output_tokens_per_s")),
    ("output tokens", ("summary", "tokens", "completion")),
    ("goodput req/s", ("summary", "throughput", "goodput_requests_per_s")),
    ("SLO attainment", ("summary", "throughput", "slo_attainment")),
    *[(f"{m} {p} ms", ("summary", "latency_ms", m, p))
      for m in ("ttft", "itl", "tpot", "chunk_gap", "e2e") for p in ("p50", "p90", "p99", "p99.9")],
    ("cache-hit rate", ("summary", "cache", "hit_rate")),
    ("revenue $/h", ("summary", "money", "revenue_per_hour")),
    ("revenue $/GPU-h", ("summary", "money", "revenue_per_gpu_hour")),
    ("usage contradictions", ("summary", "tokens", "usage_mismatch_requests")),
    ("client loop lag p99 ms", ("client", "loop_lag_ms", "p99")),
]


def lookup(doc: dict, path: tuple):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def diff_rows(a: dict, b: dict) -> list[tuple[str, object, object, object, object]]:
    rows: list[tuple[str, object, object, object, object]] = []
    for label, path in ROWS:
        x, y = lookup(a, path), lookup(b, path)
        delta = y - x if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None
        ratio = y / x if delta is not None and x else None
        rows.append((label, x, y, delta, ratio))
    return rows


def _f(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.4g}" if isinstance(x, float) else f"{x:,}"


def compare_table(a: dict, b: dict, title: str) -> Table:
    t = new_table(title, ("figure", "A", "B", "B - A", "B / A"))
    for label, x, y, d, r in diff_rows(a, b):
        add_row(t, (label, _f(x), _f(y), _f(d), "-" if r is None else f"{r:,.3f}"))
    return t


def print_compare(path_a: str, path_b: str, console: Console | None = None) -> None:
    a, b = read_result(path_a), read_result(path_b)
    show(console or Console(), compare_table(a, b, f"A = {path_a}   B = {path_b}"))
