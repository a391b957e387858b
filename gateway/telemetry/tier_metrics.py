"""Online and batch work apart on /metrics: the batch tier's lines, worker-busy seconds and
revenue by tier, and the utilisation each tier gave the workers over the last minute.

The busy seconds and the lines come from the live snapshot's `tiers` (gateway/telemetry/
snapshot.py, which splits each worker's busy time by the tiers of the sequences it ran);
revenue and requests are counted here from each settled request, as the other money series.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from billing.pricing import TIERS
from billing.request_finished import RequestFinished


class TierMetrics:
    def __init__(self, model: str, registry: CollectorRegistry):
        self.model = model
        label = ["model_name"]
        r = registry
        self.revenue = Counter("inferstack:tier_revenue_usd",
                               "Billed dollars by tier (online, batch)", label + ["tier"],
                               registry=r)
        self.requests = Counter("inferstack:tier_requests",
                                "Settled requests by tier (a batch line is one request)",
                                label + ["tier"], registry=r)
        self.busy = Counter("inferstack:worker_busy_seconds",
                            "Worker-busy seconds (GPU-seconds at work), split by the tiers of "
                            "the sequences each worker ran", label + ["tier"], registry=r)
        self.utilisation = Gauge("inferstack:tier_utilisation",
                                 "Busy seconds of each tier per worker-second over the last "
                                 "minute; the batch one is the utilisation the tier added",
                                 label + ["tier"], registry=r)
        self.batch_share = Gauge("inferstack:batch_busy_share",
                                 "Share of all worker-busy seconds so far spent on batch lines",
                                 label, registry=r)
        self.lines = Gauge("inferstack:batch_lines",
                           "Lines of open batches: waiting (not yet admitted) or running",
                           label + ["state"], registry=r)
        self.batches_open = Gauge("inferstack:batches_open",
                                  "Batches validating, in progress or finalizing", label,
                                  registry=r)
        self._busy_seen = dict.fromkeys(TIERS, 0.0)
        for tier in TIERS:  # both tiers from the start: a rate over "batch" exists at 0
            self.revenue.labels(model, tier)
            self.requests.labels(model, tier)
            self.busy.labels(model, tier)

    def observe_settled(self, done: RequestFinished) -> None:
        self.revenue.labels(self.model, done.tier).inc(done.cost.total)
        self.requests.labels(self.model, done.tier).inc()

    def refresh(self, tiers: dict) -> None:
        """From a snapshot's `tiers` frame."""
        m = self.model
        busy = tiers.get("busy_seconds", {})
        for tier in TIERS:
            total = float(busy.get(tier, 0.0))
            if total > self._busy_seen[tier]:  # the split only grows
                self.busy.labels(m, tier).inc(total - self._busy_seen[tier])
                self._busy_seen[tier] = total
            self.utilisation.labels(m, tier).set(
                tiers.get("utilisation_last_minute", {}).get(tier, 0.0))
        self.batch_share.labels(m).set(tiers.get("busy_share_batch", 0.0))
        self.lines.labels(m, "waiting").set(tiers.get("lines_waiting", 0))
        self.lines.labels(m, "running").set(tiers.get("lines_running", 0))
        self.batches_open.labels(m).set(tiers.get("batches_open", 0))
