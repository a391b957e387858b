"""The console's data model: feed frames folded into plain views the widgets draw.

Pure Python, no Textual: `ConsoleState.apply(frame)` never raises (a malformed frame is
counted and skipped), and every `*_view()` returns a frozen dataclass, so a widget holding
it in a reactive repaints only when what it shows has changed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from console.spans import TraceBook

HOURS_PER_YEAR = 8760
HISTORY = 120  # snapshots kept per series (two minutes at one a second)


def _num(d: Any, key: str, default: float = 0.0) -> float:
    v = d.get(key, default) if isinstance(d, dict) else default
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _opt(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _dict(d: Any, key: str) -> dict:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _list(d: Any, key: str) -> list:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, list) else []


def margin(per_gpu_hour: float, gpu_cost_per_hour: float) -> float | None:
    """Revenue over cost, as a fraction of cost: (revenue - cost) / cost."""
    if gpu_cost_per_hour <= 0:
        return None
    return (per_gpu_hour - gpu_cost_per_hour) / gpu_cost_per_hour


def annual_projection(per_gpu_hour: float, fleet_gpus: int) -> float:
    return per_gpu_hour * fleet_gpus * HOURS_PER_YEAR


@dataclass(frozen=True)
class HeaderView:
    model: str
    num_workers: int
    uptime_s: float
    connection: str
    paused: bool
    num_malformed: int


@dataclass(frozen=True)
class WorkerView:
    index: int
    device: str
    alive: bool
    utilisation: float
    utilisation_source: str
    util_history: tuple[float, ...]
    cpu_percent: float
    memory_used: float
    memory_total: float
    kv_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    running: int
    waiting: int
    tokens_per_s: float
    restarts: int


@dataclass(frozen=True)
class CacheView:
    hit_rate: float | None
    hit_rate_last_minute: float | None
    history: tuple[float, ...]
    hit_tokens: float
    miss_tokens: float


@dataclass(frozen=True)
class TierView:
    """Online and batch work apart, while the gateway runs the batch tier."""

    batches_open: int
    lines_waiting: int
    lines_running: int
    revenue_online: float  # since the gateway started
    revenue_batch: float
    per_gpu_hour_batch: float  # the batch tier's revenue per GPU-hour, last hour
    busy_share_batch: float  # of all worker-busy seconds so far
    util_online: float  # busy per worker-second, last minute
    util_batch: float  # the utilisation the batch tier added


@dataclass(frozen=True)
class RevenueView:
    last_minute: float
    last_hour: float
    per_gpu_hour: float
    gpu_cost_per_hour: float
    gpus: int
    hit: float
    miss: float
    output: float
    total: float
    margin: float | None
    fleet_gpus: int
    annual: float
    batch: TierView | None = None  # None: no batch tier


@dataclass(frozen=True)
class QueueView:
    length: int
    by_priority: tuple[tuple[str, int], ...]
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    finished: int
    running: int
    batch: TierView | None = None  # None: no batch tier


@dataclass(frozen=True)
class TenantView:
    tenant: str
    requests: int
    hit_tokens: float
    miss_tokens: float
    output_tokens: float
    spend: float


@dataclass(frozen=True)
class FleetGatewayView:
    gateway_id: str
    address: str
    is_self: bool
    workers: int
    alive: int
    draining: int
    running: int
    queue: int
    load: float  # mean over its workers
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class FleetView:
    gateways: tuple[FleetGatewayView, ...]
    workers: int
    requests: int | None  # from the ledger (every gateway's when shared)
    revenue: float | None
    hit_rate: float | None


def _fleet_gateway(g: dict, me: str, now: float | None) -> FleetGatewayView:
    workers = [w for w in _list(g, "workers") if isinstance(w, dict)]
    beat = _opt(g, "heartbeat")
    return FleetGatewayView(
        gateway_id=str(g.get("id", "?")), address=str(g.get("address", "?")),
        is_self=g.get("id") == me, workers=len(workers),
        alive=sum(bool(w.get("alive")) for w in workers),
        draining=sum(bool(w.get("draining")) for w in workers),
        running=int(_num(g, "running")), queue=int(_num(g, "queue")),
        load=sum(_num(w, "load") for w in workers) / len(workers) if workers else 0.0,
        heartbeat_age_s=max(0.0, now - beat) if now is not None and beat is not None else None)


class ConsoleState:
    """Everything the console knows, folded from hello, snapshot and spans frames."""

    def __init__(self, fleet_gpus: int = 128, history: int = HISTORY, max_requests: int = 200):
        self.fleet_gpus = fleet_gpus
        self.hello: dict = {}
        self.snapshot: dict = {}
        self.connection = "connecting"
        self.paused = False
        self.num_frames = 0
        self.num_malformed = 0
        self.num_snapshots = 0
        self.last_frame_at: float | None = None
        self.util_history: dict[int, deque[float]] = {}
        self.hit_rate_history: deque[float] = deque(maxlen=history)
        self.traces = TraceBook(max_requests)
        self._touched: list[str] = []
        self.span_model = ""  # the model named by the latest request span
        self._history = history

    # folding

    def apply(self, frame: Any, received_at: float | None = None) -> str | None:
        """Fold one frame in; returns its type, or None when it was malformed (and counted)."""
        kind = frame.get("type") if isinstance(frame, dict) else None
        handler = {"hello": self._hello, "snapshot": self._snapshot,
                   "spans": self._spans}.get(kind)
        if handler is None:
            self.num_malformed += 1
            return None
        try:
            handler(frame)
        except (KeyError, TypeError, ValueError, AttributeError):
            self.num_malformed += 1
            return None
        self.num_frames += 1
        self.last_frame_at = received_at
        return kind

    def _hello(self, frame: dict) -> None:
        self.hello = frame

    def _snapshot(self, frame: dict) -> None:
        self.snapshot = frame
        self.num_snapshots += 1
        for w in _list(frame, "workers"):
            if isinstance(w, dict):
                idx = int(_num(w, "index"))
                hist = self.util_history.setdefault(idx, deque(maxlen=self._history))
                hist.append(_num(w, "utilisation"))
        cache = _dict(frame, "cache")
        rate = _opt(cache, "hit_rate_last_minute")
        if rate is None:
            rate = _opt(cache, "hit_rate")
        if rate is not None:
            self.hit_rate_history.append(rate)

    def _spans(self, frame: dict) -> None:
        touched = self.traces.add_frame(frame)
        self._touched.extend(touched)
        for trace_id in touched:
            trace = self.traces.get(trace_id)
            model = trace.attr("gen_ai.request.model") if trace else None
            self.span_model = str(model) if model else self.span_model

    def drain_touched(self) -> list[str]:
        """Trace ids changed since the last call, each once, in arrival order."""
        touched, self._touched = list(dict.fromkeys(self._touched)), []
        return touched

    # views

    def header_view(self) -> HeaderView:
        snap_workers = _list(self.snapshot, "workers")
        workers = int(_num(self.hello, "workers", len(snap_workers))) or len(snap_workers)
        model = str(self.hello.get("model") or "unknown")
        if model == "unknown":  # a hello sent before the workers were up
            model = self.span_model or "—"
        return HeaderView(model=model, num_workers=workers,
                          uptime_s=_num(self.snapshot, "uptime_s"), connection=self.connection,
                          paused=self.paused, num_malformed=self.num_malformed)

    def worker_views(self) -> tuple[WorkerView, ...]:
        views = []
        for w in _list(self.snapshot, "workers"):
            if not isinstance(w, dict):
                continue
            idx = int(_num(w, "index"))
            views.append(WorkerView(
                index=idx, device=str(w.get("device", "?")), alive=bool(w.get("alive", True)),
                utilisation=_num(w, "utilisation"),
                utilisation_source=str(w.get("utilisation_source", "")),
                util_history=tuple(self.util_history.get(idx, ())),
                cpu_percent=_num(w, "cpu_percent"), memory_used=_num(w, "memory_used_bytes"),
                memory_total=_num(w, "memory_total_bytes"), kv_usage=_num(w, "kv_usage"),
                kv_blocks_used=int(_num(w, "kv_blocks_used")),
                kv_blocks_total=int(_num(w, "kv_blocks_total")),
                running=int(_num(w, "running")), waiting=int(_num(w, "waiting")),
                tokens_per_s=_num(w, "tokens_per_s"), restarts=int(_num(w, "restarts"))))
        return tuple(views)

    def cache_view(self) -> CacheView:
        c = _dict(self.snapshot, "cache")
        return CacheView(hit_rate=_opt(c, "hit_rate"),
                         hit_rate_last_minute=_opt(c, "hit_rate_last_minute"),
                         history=tuple(self.hit_rate_history),
                         hit_tokens=_num(c, "hit_tokens"), miss_tokens=_num(c, "miss_tokens"))

    def revenue_view(self) -> RevenueView:
        r = _dict(self.snapshot, "revenue")
        total = _dict(r, "total")
        prices = _dict(self.hello, "prices")
        cost = _num(r, "gpu_cost_per_hour", _num(prices, "gpu_cost_per_hour"))
        per_gpu_hour = _num(r, "per_gpu_hour")
        return RevenueView(
            last_minute=_num(r, "last_minute"), last_hour=_num(r, "last_hour"),
            per_gpu_hour=per_gpu_hour, gpu_cost_per_hour=cost, gpus=int(_num(r, "gpus")),
            hit=_num(total, "cache_hit_input"), miss=_num(total, "cache_miss_input"),
            output=_num(total, "output"), total=_num(total, "total"),
            margin=margin(per_gpu_hour, cost), fleet_gpus=self.fleet_gpus,
            annual=annual_projection(per_gpu_hour, self.fleet_gpus), batch=self.tier_view())

    def tier_view(self) -> TierView | None:
        """The batch tier beside online work; None when the gateway runs none."""
        t = _dict(self.snapshot, "tiers")
        if t.get("batch_enabled") is not True:
            return None
        revenue, util = _dict(t, "revenue"), _dict(t, "utilisation_last_minute")
        return TierView(
            batches_open=int(_num(t, "batches_open")), lines_waiting=int(_num(t, "lines_waiting")),
            lines_running=int(_num(t, "lines_running")),
            revenue_online=_num(revenue, "online"), revenue_batch=_num(revenue, "batch"),
            per_gpu_hour_batch=_num(_dict(t, "per_gpu_hour"), "batch"),
            busy_share_batch=_num(t, "busy_share_batch"), util_online=_num(util, "online"),
            util_batch=_num(util, "batch"))

    def queue_view(self) -> QueueView:
        q = _dict(self.snapshot, "queue")
        lat = _dict(self.snapshot, "latency")
        req = _dict(self.snapshot, "requests")
        by_priority = tuple(sorted(((str(k), int(_num(q["by_priority"], k)))
                                    for k in _dict(q, "by_priority")),
                                   key=lambda kv: (len(kv[0]), kv[0])))
        return QueueView(length=int(_num(q, "length")), by_priority=by_priority,
                         ttft_p50=_opt(lat, "ttft_p50"), ttft_p99=_opt(lat, "ttft_p99"),
                         itl_p50=_opt(lat, "itl_p50"), itl_p99=_opt(lat, "itl_p99"),
                         finished=int(_num(req, "finished")), running=int(_num(req, "running")),
                         batch=self.tier_view())

    def fleet_view(self) -> FleetView | None:
        """The fleet as the gateway last read it from Redis; None without a registry."""
        f = self.snapshot.get("fleet") if isinstance(self.snapshot, dict) else None
        if not isinstance(f, dict):
            return None
        me, now = f.get("self"), _opt(self.snapshot, "time")
        gateways = tuple(_fleet_gateway(g, str(me), now) for g in _list(f, "gateways")
                         if isinstance(g, dict))
        totals = f.get("totals") if isinstance(f.get("totals"), dict) else None
        return FleetView(
            gateways=gateways, workers=sum(g.workers for g in gateways),
            requests=int(_num(totals, "requests")) if totals else None,
            revenue=_opt(totals, "cost_total") if totals else None,
            hit_rate=_opt(totals, "cache_hit_rate") if totals else None)

    def tenant_views(self) -> tuple[TenantView, ...]:
        views = [TenantView(tenant=str(t.get("tenant", "?")), requests=int(_num(t, "requests")),
                            hit_tokens=_num(t, "hit_tokens"), miss_tokens=_num(t, "miss_tokens"),
                            output_tokens=_num(t, "output_tokens"), spend=_num(t, "spend"))
                 for t in _list(self.snapshot, "tenants") if isinstance(t, dict)]
        return tuple(sorted(views, key=lambda v: (-v.spend, v.tenant)))
