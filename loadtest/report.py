"""The final table on the terminal (rich), from a result document."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

LAT = ("ttft", "itl", "tpot", "e2e", "e2e_from_intended", "schedule_lag")
PCT = ("p50", "p90", "p99", "p99.9")


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def latency_table(summary: dict, title: str = "latency (ms)") -> Table:
    t = Table(title=title)
    t.add_column("metric")
    for col in ("count", "mean", *PCT, "max"):
        t.add_column(col, justify="right")
    for name in LAT:
        s = summary["latency_ms"][name]
        t.add_row(name, fmt(s["count"]), *(fmt(s[c], 2) for c in ("mean", *PCT, "max")))
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
        ("usage check", f"{tok['usage_mismatch_requests']} mismatched, "
                        f"{tok['completion_reported']} reported / "
                        f"{tok['completion_arrived']} arrived"),
        ("revenue", f"${m['revenue']['total']:.6f} ({m['price_book']}, "
                    f"sources {m['sources']}); ${m['revenue_per_hour']:.4f}/h, "
                    f"${fmt(m['revenue_per_gpu_hour'], 4)}/GPU-h"),
    ]


def _pct(x):
    return None if x is None else 100 * x


def group_table(groups: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("group", "ok", "fail", "req/s", "good/s", "TTFT50", "TTFT99", "ITL50",
                "ITL99", "hit", "$/GPU-h"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, s in groups.items():
        lat, hit = s["latency_ms"], s["cache"]["hit_rate"]
        t.add_row(name, fmt(s["requests"]["completed"]), fmt(s["requests"]["failed"]),
                  fmt(s["throughput"]["requests_per_s"], 2),
                  fmt(s["throughput"]["goodput_requests_per_s"], 2),
                  fmt(lat["ttft"]["p50"], 1), fmt(lat["ttft"]["p99"], 1),
                  fmt(lat["itl"]["p50"], 2), fmt(lat["itl"]["p99"], 2),
                  "-" if hit is None else f"{100 * hit:.1f}%",
                  fmt(s["money"]["revenue_per_gpu_hour"], 4))
    return t


def print_report(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    s = result["summary"]
    head = Table(title=f"load test: {result['run'].get('workload')} -> {result['run'].get('url')}",
                 show_header=False)
    for k, v in headline_rows(s):
        head.add_row(k, v)
    lag = result["client"]["loop_lag_ms"]
    head.add_row("client loop lag", f"p99 {fmt(lag['p99'], 2)} ms, max {fmt(lag['max'], 2)} ms")
    console.print(head)
    console.print(latency_table(s))
    for key, title in (("by_priority", "by priority class"), ("by_tenant", "by tenant")):
        if len(result[key]) > 1:
            console.print(group_table(result[key], title))
