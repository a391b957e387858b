"""The gauges of the live feed, read once a second from the gateway's state."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from billing.request_finished import RequestFinished
from gateway.telemetry.rolling_totals import RollingTotals
from gateway.telemetry.tier_usage import TierUsage, worker_mixes
from numeric.percentiles import percentile

if TYPE_CHECKING:
    from gateway.serving.accounting import Accounting
    from gateway.serving.batch_view import BatchTierView
    from gateway.serving.dispatch import Dispatcher
    from gateway.serving.inflight import InFlightTable
    from gateway.serving.queue import RequestQueue
    from gateway.workers.handle import WorkerHandle


class FleetView(Protocol):
    """What a snapshot reads of the gateway (its state): the workers, the queue, the money."""

    started_at: float
    model_name: str
    workers: list[WorkerHandle]
    dispatcher: Dispatcher
    queue: RequestQueue
    accounting: Accounting
    inflight: InFlightTable
    batch: BatchTierView | None  # the batch tier's runner; None: off


class SnapshotBuilder:
    def __init__(self, state: FleetView):
        self.state = state
        self.rolling = RollingTotals()
        self.tenants: dict[str, dict] = {}
        self.hits = self.misses = self.finished = 0
        self._previous: dict[int, dict] = {}  # worker index -> last stats, for rates
        self.fleet: Callable[[], dict] | None = None  # the fleet registry's view, with Redis
        self.tiers = TierUsage()
        self.batch_dollars = RollingTotals()  # the batch tier's share of `rolling`'s dollars
        hooks = getattr(getattr(state, "accounting", None), "before_settle", None)
        if hooks is not None:  # None: a stand-in state (tests)
            hooks.append(self.look_at_tiers)

    # ---- fed by the accounting when a request settles -----------------------------------
    def on_settled(self, done: RequestFinished) -> None:
        miss = done.miss_tokens
        self.hits += done.cached_tokens
        self.misses += miss
        self.finished += 1
        timing = done.worker_timing or {}
        itl = None
        if done.completion_tokens > 1 and timing.get("first_token") and timing.get("finished"):
            itl = (timing["finished"] - timing["first_token"]) / (done.completion_tokens - 1)
        if done.tier == "batch":  # its wait is by design: the latencies are online ones
            self.rolling.add(done.cached_tokens, miss, done.cost.total, None, None)
            self.batch_dollars.add(0, 0, done.cost.total, None, None)
        else:
            self.rolling.add(done.cached_tokens, miss, done.cost.total, done.ttft_seconds, itl)
        t = self.tenants.setdefault(done.tenant, {
            "tenant": done.tenant, "requests": 0, "hit_tokens": 0, "miss_tokens": 0,
            "output_tokens": 0, "spend": 0.0})
        t["requests"] += 1
        t["hit_tokens"] += done.cached_tokens
        t["miss_tokens"] += miss
        t["output_tokens"] += done.completion_tokens
        t["spend"] += done.cost.total

    # ---- the frame ----------------------------------------------------------------------
    def build(self) -> dict:
        state = self.state
        now = time.time()
        return {"type": "snapshot", "time": now, "uptime_s": now - state.started_at,
                "model": state.model_name,  # also here: a hello may precede the first worker
                "workers": [self._worker(w, now) for w in state.workers],
                "queue": self._queue(), "cache": self._cache(), "revenue": self._revenue(now),
                "latency": self._latency(),
                "requests": {"finished": self.finished,
                             "running": sum(w.num_inflight for w in state.workers)},
                "tenants": sorted(self.tenants.values(), key=lambda t: -t["spend"]),
                "tiers": self.tier_frame(now),
                **({"fleet": self.fleet()} if self.fleet is not None else {})}

    def _worker(self, w, now: float) -> dict:
        s = w.stats
        prev = self._previous.get(w.index)
        util = cpu = tps = 0.0
        if prev is not None and s.get("wall") and prev.get("wall") and s["wall"] > prev["wall"]:
            span = s["wall"] - prev["wall"]
            util = min(1.0, (s.get("busy_seconds", 0) - prev.get("busy_seconds", 0)) / span)
            cpu = 100.0 * (s.get("cpu_seconds", 0) - prev.get("cpu_seconds", 0)) / span
            tps = (s.get("generation_tokens", 0) - prev.get("generation_tokens", 0)) / span
        if s.get("wall") != (prev or {}).get("wall"):
            self._previous[w.index] = dict(s)
        elif prev is not None:  # no new stats since last tick: keep the last rates
            util, cpu, tps = prev.get("_util", 0.0), prev.get("_cpu", 0.0), prev.get("_tps", 0.0)
        if w.index in self._previous:
            self._previous[w.index].update(_util=util, _cpu=cpu, _tps=tps)
        nvml = "gpu_utilisation" in s
        total = s.get("kv_blocks_total") or 0
        return {"index": w.index, "device": w.info.device if w.info else "?", "alive": w.alive,
                "url": getattr(w, "url", None),
                "draining": w.index in self.state.dispatcher.draining,
                "pid": w.pid, "utilisation": s["gpu_utilisation"] if nvml else util,
                "utilisation_source": "nvml" if nvml else "busy-fraction",
                "cpu_percent": cpu, "memory_used_bytes": s.get("memory_used_bytes", 0),
                "memory_total_bytes": s.get("memory_total_bytes", 0),
                "kv_usage": s.get("kv_blocks_used", 0) / total if total else 0.0,
                "kv_blocks_used": s.get("kv_blocks_used", 0), "kv_blocks_total": total,
                "running": s.get("running", 0), "waiting": s.get("waiting", 0),
                "tokens_per_s": tps, "restarts": w.restarts}

    def _queue(self) -> dict:
        by_priority: dict[str, int] = {}
        for entry in self.state.queue.waiting():
            by_priority[str(entry.priority)] = by_priority.get(str(entry.priority), 0) + 1
        return {"length": len(self.state.queue), "by_priority": by_priority}

    def _cache(self) -> dict:
        hit, miss, _ = self.rolling.sums(60)
        total = self.hits + self.misses
        return {"hit_tokens": self.hits, "miss_tokens": self.misses,
                "hit_rate": self.hits / total if total else 0.0,
                "hit_rate_last_minute": hit / (hit + miss) if hit + miss else 0.0}

    def _revenue(self, now: float) -> dict:
        acc = self.state.accounting
        gpus = max(1, len(self.state.workers))
        last_hour = self.rolling.sums(3600)[2]
        window = min(3600.0, max(1.0, now - self.state.started_at))
        # the GPU time the last hour really had, as the pool grew and shrank in it
        clock = self.state.dispatcher.worker_time
        gpu_hours = clock.between(now - window, now) / 3600
        return {"total": acc.revenue.as_dict(),
                "last_minute": self.rolling.sums(60)[2],
                "last_hour": last_hour,
                "per_gpu_hour": last_hour / gpu_hours if gpu_hours > 0 else 0.0,
                "gpu_cost_per_hour": acc.prices.gpu_cost_per_hour, "gpus": gpus,
                "gpu_hours_last_hour": gpu_hours, "gpu_seconds_total": clock.total(now)}

    # ---- online and batch apart --------------------------------------------------------
    def look_at_tiers(self) -> None:
        """Split the workers' busy time since the last look between the tiers."""
        state = self.state
        mixes = worker_mixes(state.workers, state.inflight.slots.on,
                             state.accounting.batch_sequences())
        self.tiers.look(mixes, state.dispatcher.worker_time.total())

    def tier_frame(self, now: float | None = None) -> dict:
        """Online and batch work apart: the batch tier's lines, busy seconds and the
        utilisation each tier gave the workers, revenue by tier."""
        now = time.time() if now is None else now
        self.look_at_tiers()
        state = self.state
        batch = getattr(state, "batch", None)
        window = min(3600.0, max(1.0, now - state.started_at))
        gpu_hours = state.dispatcher.worker_time.between(now - window, now) / 3600
        last_hour = self.rolling.sums(3600)[2]
        batch_hour = self.batch_dollars.sums(3600)[2]
        hourly = {"online": last_hour - batch_hour, "batch": batch_hour}
        return {
            "batch_enabled": batch is not None,
            "batches_open": batch.batches_open if batch is not None else 0,
            "lines_waiting": batch.lines_waiting if batch is not None else 0,
            "lines_running": batch.lines_running if batch is not None else 0,
            "busy_seconds": dict(self.tiers.busy),
            "busy_share_batch": self.tiers.batch_share,
            "utilisation_last_minute": self.tiers.recent(),
            "revenue": {t: c.total for t, c in state.accounting.revenue_by_tier.items()},
            "revenue_last_hour": hourly,
            "per_gpu_hour": {t: v / gpu_hours if gpu_hours > 0 else 0.0
                             for t, v in hourly.items()}}

    def _latency(self) -> dict:
        ttft, itl = self.rolling.recent_latencies()
        ttft.sort()
        itl.sort()
        return {"ttft_p50": _percentile(ttft, 50), "ttft_p99": _percentile(ttft, 99),
                "itl_p50": _percentile(itl, 50), "itl_p99": _percentile(itl, 99)}


def _percentile(values: list[float], p: float) -> float | None:
    """The feed's percentile: None (JSON null) rather than NaN when there are no values."""
    return percentile(values, p) if values else None
