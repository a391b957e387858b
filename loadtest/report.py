"""The final tables on the terminal (rich), from a result document. They go through
loadtest/tables.py, so no number is ever cut, whatever the width (a file gets 80 columns)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from loadtest.tables import add_row, new_table, show

LAT = ("ttft", "itl", "tpot", "chunk_gap", "e2e", "e2e_from_intended", "schedule_lag")
# how a request's output tokens were counted (record.count_source), as the report says it
COUNTED = {"usage": "from the server's usage", "logprobs": "from logprob entries",
           "chunks": "estimated from chunks, one token per message"}
PCT = ("p50", "p90", "p99", "p99.9")


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def latency_table(summary: dict, title: str = "latency (ms)") -> Table:
    t = new_table(title, ("metric", "count", "mean", *PCT, "max"))
    for name in LAT:
        s = summary["latency_ms"][name]
        add_row(t, (name, fmt(s["count"]), *(fmt(s[c], 2) for c in ("mean", *PCT, "max"))))
    return t


def headline_rows(s: dict) -> list[tuple[str, str]]:
    req, thr, m = s["requests"], s["throughput"], s["money"]
    tok, cache = s["tokens"], s["cache"]
    errors = ", ".join(f"{k}={v}" for k, v in sorted(req["errors"].items())) or "none"
    hit = cache["hit_rate"]
    return [
        ("requests", f"{req['completed']} ok / {req['failed']} failed / {req['good']} good"),
        ("errors", errors),
        ("duration", f"{s['duration_s']:.2f} s"),
        ("throughput", f"{thr['requests_per_s']:.2f} req/s, "
                       f"{thr['output_tokens_per_s']:.1f} output tok/s"),
        ("goodput", f"{thr['goodput_requests_per_s']:.2f} req/s "
                    f"(SLO attainment {fmt(_pct(thr['slo_attainment']))}%)"),
        ("cache-hit rate", "-" if hit is None else f"{100 * hit:.1f}% of prompt tokens"),
        *token_rows(tok),
        ("revenue", f"${m['revenue']['total']:.6f} ({m['price_book']}, "
                    f"sources {m['sources']}); ${m['revenue_per_hour']:.4f}/h, "
                    f"${fmt(m['revenue_per_gpu_hour'], 4)}/GPU-h"),
    ]


def token_rows(tok: dict) -> list[tuple[str, str]]:
    """How many output tokens and how they were counted; a usage check row only when a
    server's usage contradicts its stream (an estimate from chunks never does)."""
    how = "; ".join(f"{fmt(n)} requests {COUNTED[k]}" for k, n in
                    sorted(tok["counted_from"].items()))
    rows = [("output tokens", f"{fmt(tok['completion'])} ({how or 'no successful requests'})")]
    if tok["requests_without_usage"]:
        rows.append(("usage", f"{fmt(tok['requests_without_usage'])} requests reported none"))
    if tok["usage_mismatch_requests"]:
        rows.append(("usage check", f"{fmt(tok['usage_mismatch_requests'])} requests' usage "
                                    f"contradicts their stream: "
                                    f"{fmt(tok['completion_reported'])} reported / "
                                    f"{fmt(tok['completion_arrived'])} counted"))
    return rows


def _pct(x):
    return None if x is None else 100 * x


def group_table(groups: dict, title: str) -> Table:
    t = new_table(title, ("group", "ok", "fail", "req/s", "good/s", "TTFT50", "TTFT99",
                          "ITL50", "ITL99", "hit", "$/GPU-h"))
    for name, s in groups.items():
        lat, hit = s["latency_ms"], s["cache"]["hit_rate"]
        add_row(t, (name, fmt(s["requests"]["completed"]), fmt(s["requests"]["failed"]),
                    fmt(s["throughput"]["requests_per_s"], 2),
                    fmt(s["throughput"]["goodput_requests_per_s"], 2),
                    fmt(lat["ttft"]["p50"], 1), fmt(lat["ttft"]["p99"], 1),
                    fmt(lat["itl"]["p50"], 2), fmt(lat["itl"]["p99"], 2),
                    "-" if hit is None else f"{100 * hit:.1f}%",
                    fmt(s["money"]["revenue_per_gpu_hour"], 4)))
    return t


def headline_table(result: dict) -> Table:
    run = result["run"]
    head = new_table(f"load test: {run.get('workload')} -> {run.get('url')}", ("", ""),
                     prose=1, show_header=False)
    for row in headline_rows(result["summary"]):
        add_row(head, row)
    lag = result["client"]["loop_lag_ms"]
    add_row(head, ("client loop lag",
                   f"p99 {fmt(lag['p99'], 2)} ms, max {fmt(lag['max'], 2)} ms"))
    return head


def report_tables(result: dict) -> list[Table]:
    tables = [headline_table(result), latency_table(result["summary"])]
    for key, title in (("by_priority", "by priority class"), ("by_tenant", "by tenant")):
        if len(result[key]) > 1:
            tables.append(group_table(result[key], title))
    return tables


def print_report(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    for table in report_tables(result):
        show(console, table)
