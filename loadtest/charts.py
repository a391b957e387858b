"""PNG charts of a run: latency distributions (CDFs) and throughput and latency over time."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.record import RequestRecord  # noqa: E402


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def latency_chart(records: list[RequestRecord], path: str) -> None:
    ok = [r for r in records if r.ok and not r.warmup]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    series = [("TTFT", [r.ttft * 1000 for r in ok if r.ttft is not None]),
              ("ITL (per token)", [g * 1000 for r in ok for g in r.itls()]),
              ("end-to-end", [r.e2e * 1000 for r in ok])]
    for ax, (name, values) in zip(axes, series):
        _cdf(ax, values, name)
        ax.set_title(f"{name} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL (per token)" else "fraction")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline_chart(ts: dict, path: str, window: tuple[float, float] | None = None) -> None:
    t, b = ts["t"], ts["bucket_s"]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    top.plot(t, [x / b for x in ts["output_tokens"]], label="output tokens/s")
    top.plot(t, [x / b for x in ts["finished"]], label="requests finished/s")
    top.set_yscale("symlog")
    top.legend()
    mid.plot(t, [x if x is not None else float("nan") for x in ts["ttft_p50_ms"]],
             label="TTFT p50 (ms)")
    mid.plot(t, [x if x is not None else float("nan") for x in ts["e2e_p50_ms"]],
             label="e2e p50 (ms)")
    mid.legend()
    if ts["in_flight"]:
        low.plot(t, ts["in_flight"], label="in flight")
    low.bar(t, ts["errors"], width=b * 0.8, color="tab:red", label="errors")
    low.legend()
    low.set_xlabel("seconds since start")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
        if window:
            ax.axvspan(*window, color="tab:green", alpha=0.06)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_charts(records: list[RequestRecord], result: dict, folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    lat, tl = os.path.join(folder, "latency.png"), os.path.join(folder, "timeline.png")
    latency_chart(records, lat)
    measured = [r.intended for r in records if not r.warmup]
    window = (min(measured), max(measured)) if measured else None
    timeline_chart(result["timeseries"], tl, window)
    return [lat, tl]
