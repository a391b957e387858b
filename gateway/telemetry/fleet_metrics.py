"""The fleet on /metrics: every gateway and worker, fleet revenue and cache-hit rate, read
from the fleet registry's latest view (Redis heartbeats, and totals from the ledger, which
with --state-url is the shared one), not summed from per-gateway series.

Every gateway of a fleet shows the same values, so a scrape that reaches any one child of
a `--gateways N` host (SO_REUSEPORT picks it) reads the whole fleet; this gateway's own
counters stay in its other series. Series of a gateway that left are dropped with it.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

TOKEN_KINDS = ("cache_hit_tokens", "cache_miss_tokens", "output_tokens")


def _worker_key(gateway: dict, worker: dict) -> str:
    """A shared (remote) worker is one worker whichever gateway lists it; a local one is its
    gateway's own."""
    return worker.get("url") or f"{gateway.get('id')}#{worker.get('index')}"


class FleetMetrics:
    def __init__(self, model: str, registry: CollectorRegistry):
        self.model = model

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge("inferstack:fleet_" + name, doc, ["model_name", *labels],
                         registry=registry)
        self.gateways = gauge("gateways", "Live gateways in the fleet")
        self.queue = gauge("gateway_queue_length", "Requests waiting in each gateway's queue",
                           "gateway")
        self.running = gauge("gateway_running", "Requests each gateway has running on workers",
                             "gateway")
        self.draining = gauge("gateway_draining", "1 while the gateway drains", "gateway")
        self.workers = gauge("workers", "Distinct workers in the fleet (a shared worker counts "
                                        "once)")
        self.workers_alive = gauge("workers_alive", "Distinct workers in the fleet that are alive")
        self.revenue = gauge("revenue_usd", "Dollars billed over the whole ledger")
        self.requests = gauge("requests", "Requests in the whole ledger")
        self.tokens = gauge("tokens", "Billed tokens in the whole ledger", "kind")
        self.hit_rate = gauge("cache_hit_rate",
                              "Cache-hit share of billed input tokens, whole ledger")
        self.age = gauge("view_age_seconds", "Seconds since the fleet view was read from Redis")

    def refresh(self, view: dict, now: float | None = None) -> None:
        m = self.model
        gateways = view.get("gateways") or []
        self.gateways.labels(m).set(len(gateways))
        for gauge in (self.queue, self.running, self.draining):
            gauge.clear()  # gateways that left take their series with them
        workers: dict[str, bool] = {}
        for g in gateways:
            ident = str(g.get("id"))
            self.queue.labels(m, ident).set(g.get("queue", 0))
            self.running.labels(m, ident).set(g.get("running", 0))
            self.draining.labels(m, ident).set(int(bool(g.get("draining"))))
            for w in g.get("workers", []):
                key = _worker_key(g, w)
                workers[key] = workers.get(key, False) or bool(w.get("alive"))
        self.workers.labels(m).set(len(workers))
        self.workers_alive.labels(m).set(sum(workers.values()))
        read_at = view.get("read_at")
        if read_at is not None:
            self.age.labels(m).set(max(0.0, (now or time.time()) - read_at))
        totals = view.get("totals")
        if totals:  # none until the ledger was first summed
            self.revenue.labels(m).set(totals.get("cost_total", 0.0))
            self.requests.labels(m).set(totals.get("requests", 0))
            self.hit_rate.labels(m).set(totals.get("cache_hit_rate", 0.0))
            for kind in TOKEN_KINDS:
                self.tokens.labels(m, kind).set(totals.get(kind, 0))
