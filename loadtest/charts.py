"""PNG charts of a run: latency distributions (CDFs) and throughput and latency over time.

Every series is drawn so that each value with data shows: time series with a marker on every
bucket (a line alone joins only neighbours, so a bucket with data between two empty ones,
plotted as NaN gaps, would be invisible), distributions as step CDFs that rise at every value
(a single request is a visible step, not a one-point line). The *_figure functions return the
matplotlib Figure (the tests read its artists and pixels); the *_chart ones write the PNG.
"""
from __future__ import annotations

import os

# Figure without pyplot: no global figure registry to close, no GUI backend to pick (a Figure
# saves a PNG through Agg whatever the backend)
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtest.record import RequestRecord

DPI = 100  # the figure's and the PNG's: a point's display position is its pixel in the file
MARK = {"marker": "o", "markersize": 3}  # on every time-series point: lone buckets show


def _cdf(ax: Axes, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        # from 0 at the smallest value, a step up of 1/n at every value
        ys = [i / len(xs) for i in range(len(xs) + 1)]
        ax.step([xs[0], *xs], ys, where="post", label=label)


def _nan(xs: list) -> list[float]:
    return [float("nan") if x is None else x for x in xs]  # None (no data) -> a gap


def latency_figure(records: list[RequestRecord]) -> Figure:
    ok = [r for r in records if r.ok and not r.warmup]
    fig = Figure(figsize=(14, 4), dpi=DPI)
    axes = fig.subplots(1, 3)
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
    return fig


def timeline_figure(ts: dict, window: tuple[float, float] | None = None) -> Figure:
    t, b = ts["t"], ts["bucket_s"]
    fig = Figure(figsize=(10, 8), dpi=DPI)
    top, mid, low = fig.subplots(3, 1, sharex=True)
    top.plot(t, [x / b for x in ts["output_tokens"]], label="output tokens/s", **MARK)
    top.plot(t, [x / b for x in ts["finished"]], label="requests finished/s", **MARK)
    top.set_yscale("symlog")
    top.legend()
    mid.plot(t, _nan(ts["ttft_p50_ms"]), label="TTFT p50 (ms)", **MARK)
    mid.plot(t, _nan(ts["e2e_p50_ms"]), label="e2e p50 (ms)", **MARK)
    mid.legend()
    if ts["in_flight"]:
        low.plot(t, ts["in_flight"], label="in flight", **MARK)
    low.bar(t, ts["errors"], width=b * 0.8, color="tab:red", label="errors")
    low.legend()
    low.set_xlabel("seconds since start")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
        if window:
            ax.axvspan(*window, color="tab:green", alpha=0.06)
    fig.tight_layout()
    return fig


def latency_chart(records: list[RequestRecord], path: str) -> None:
    latency_figure(records).savefig(path, dpi=DPI)


def timeline_chart(ts: dict, path: str, window: tuple[float, float] | None = None) -> None:
    timeline_figure(ts, window).savefig(path, dpi=DPI)


def write_charts(records: list[RequestRecord], result: dict, folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    lat, tl = os.path.join(folder, "latency.png"), os.path.join(folder, "timeline.png")
    latency_chart(records, lat)
    measured = [r.intended for r in records if not r.warmup]
    window = (min(measured), max(measured)) if measured else None
    timeline_chart(result["timeseries"], tl, window)
    return [lat, tl]
