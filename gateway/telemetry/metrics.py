"""Prometheus metrics of the gateway, with vLLM's names where they exist so dashboards work."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from billing.request_finished import RequestFinished
from gateway.telemetry.fleet_metrics import FleetMetrics
from gateway.telemetry.tier_metrics import TierMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


class WorkerCounter:
    """A counter fed from each worker's own running total (sent with its statistics): it
    grows by what the total grew since the last look. A restarted worker counts from 0
    again, and then all of its new total is new."""

    def __init__(self, name: str, doc: str, labels: list[str], registry: CollectorRegistry,
                 extra: list[str] | None = None):
        self.counter = Counter(name, doc, labels + ["worker"] + (extra or []), registry=registry)
        self.last: dict[tuple, float] = {}

    def follow(self, key: tuple, total: float) -> None:
        before = self.last.get(key, 0.0)
        grown = total - before if total >= before else total
        self.last[key] = total
        self.counter.labels(*key).inc(grown)


class WorkerSeconds:
    """Worker-seconds (GPU-seconds: one worker per device) as the pool grows and shrinks: the
    integral of the pool's size over time, exact because every change of size is reported
    (`resize`) when it happens. Recent sizes are kept for `between`, so revenue per GPU-hour
    over a window divides by the GPU time that window really had."""

    def __init__(self, count: int, now: float | None = None, keep_seconds: float = 3600.0):
        start = time.time() if now is None else now
        self.count, self.since, self.accumulated = count, start, 0.0
        self.keep_seconds = keep_seconds
        self.changes: deque[tuple[float, int]] = deque([(start, count)])  # (from, size)

    def resize(self, count: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.accumulated += (now - self.since) * self.count
        self.count, self.since = count, now
        self.changes.append((now, count))
        # keep the size in force at the oldest moment a window may still ask about
        while len(self.changes) > 1 and self.changes[1][0] <= now - self.keep_seconds:
            self.changes.popleft()

    def total(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return self.accumulated + (now - self.since) * self.count

    def between(self, start: float, end: float) -> float:
        """Worker-seconds from `start` to `end` (before the first record: its size)."""
        changes = list(self.changes)
        seconds = 0.0
        for i, (at, count) in enumerate(changes):
            until = changes[i + 1][0] if i + 1 < len(changes) else end
            lo = start if i == 0 else max(start, at)
            hi = min(end, until)
            if hi > lo:
                seconds += (hi - lo) * count
        return seconds


class GatewayMetrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              label, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed tokens",
                             label, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                             label, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time waiting in the gateway queue", label,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", label,
                                         registry=r)
        self.cached_tokens = Counter("inferstack:cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", label,
                                     registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests by finish reason",
                                label + ["finished_reason"], registry=r)
        self.http_errors = Counter("inferstack:http_errors", "Error responses by status",
                                   label + ["status"], registry=r)
        self.queue_length = Gauge("inferstack:gateway_queue_length",
                                  "Requests waiting in the gateway queue", label, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running on workers",
                             label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests waiting (gateway queue plus worker queues)", label,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1",
                              label + ["worker"], registry=r)
        # counters as vLLM exports them (`..._total`), fed from the workers' running totals
        self.prefix_queries = WorkerCounter("vllm:prefix_cache_queries",
                                            "Prefix-cache queries (tokens)", label, r)
        self.prefix_hits = WorkerCounter("vllm:prefix_cache_hits", "Prefix-cache hits (tokens)",
                                         label, r)
        self.spec_drafts = WorkerCounter("vllm:spec_decode_num_drafts", "Speculative drafts",
                                         label, r)
        self.spec_draft_tokens = WorkerCounter("vllm:spec_decode_num_draft_tokens",
                                               "Proposed tokens", label, r)
        self.spec_accepted = WorkerCounter("vllm:spec_decode_num_accepted_tokens",
                                           "Accepted tokens", label, r)
        self.spec_per_pos = WorkerCounter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens by draft position", label, r,
                                          ["position"])
        self.workers_alive = Gauge("inferstack:workers_alive", "Workers ready to serve", label,
                                   registry=r)
        # the devices paid for, alive or restarting: the divisor of revenue per GPU-hour
        self.workers = Gauge("inferstack:workers",
                             "Worker processes, one per GPU (or CPU device), alive or not",
                             label, registry=r)
        self.worker_seconds = Counter("inferstack:worker_seconds",
                                      "Worker-seconds (GPU-seconds) the pool has had, growing "
                                      "with its size: the divisor of revenue per GPU-hour",
                                      label, registry=r)
        self._worker_seconds_seen = 0.0
        self.revenue = Counter("inferstack:revenue_usd", "Billed dollars by kind and tenant",
                               label + ["kind", "tenant"], registry=r)
        self.tenant_tokens = Counter("inferstack:tenant_tokens", "Billed tokens by kind and tenant",
                                     label + ["kind", "tenant"], registry=r)
        self.budget_reserved = Gauge("inferstack:budget_reserved_usd",
                                     "Dollars reserved by requests in flight", label, registry=r)
        self.worker_restarts = Gauge("inferstack:worker_restarts", "Worker restarts", label,
                                     registry=r)
        self.dispatcher_alive = Gauge("inferstack:dispatcher_alive",
                                      "1 while the dispatch loop is ticking", label, registry=r)
        self.slots_in_use = Gauge("inferstack:worker_slots_in_use",
                                  "Requests the gateway counts as in flight on workers", label,
                                  registry=r)
        self.open_charges = Gauge("inferstack:open_charges",
                                  "Engine requests admitted and not yet settled", label,
                                  registry=r)
        self.fleet = FleetMetrics(model, r)  # refreshed from the fleet view, with Redis
        self.tiers = TierMetrics(model, r)  # online and batch apart

    def refresh_tiers(self, frame: dict) -> None:
        """Copy the batch tier's gauges and busy seconds from the snapshot's `tiers`."""
        self.tiers.refresh(frame)

    def observe_settled(self, done: RequestFinished) -> None:
        """Every request, however it ended (a client that left included), counts here once,
        from the same record as its bill."""
        m, tenant, cost = self.model, done.tenant, done.cost
        self.tiers.observe_settled(done)
        self.prompt_tokens.labels(m).inc(done.prompt_tokens)
        self.generation_tokens.labels(m).inc(done.completion_tokens)
        self.cached_tokens.labels(m).inc(done.cached_tokens)
        for reason in done.finish_reasons:
            self.requests.labels(m, reason).inc()
        online = done.tier != "batch"  # a batch line waits by design: latencies are online
        if online and done.ttft_seconds is not None:
            self.ttft.labels(m).observe(done.ttft_seconds)
        if online and done.queue_seconds is not None:
            self.queue_time.labels(m).observe(done.queue_seconds)
            self.e2e.labels(m).observe(done.e2e_seconds)
        for kind, dollars, tokens in (
                ("cache_hit_input", cost.cache_hit_input, done.cached_tokens),
                ("cache_miss_input", cost.cache_miss_input, done.miss_tokens),
                ("output", cost.output, done.completion_tokens)):
            self.revenue.labels(m, kind, tenant).inc(dollars)
            self.tenant_tokens.labels(m, kind, tenant).inc(tokens)

    def refresh(self, queue_length: int, workers, reserved: float = 0.0,
                dispatcher_alive: bool = True, open_charges: int = 0,
                worker_seconds: float | None = None) -> None:
        """Copy the gauges from the queue, the dispatcher, the accounting and the workers'
        latest statistics."""
        m = self.model
        if worker_seconds is not None and worker_seconds > self._worker_seconds_seen:
            self.worker_seconds.labels(m).inc(worker_seconds - self._worker_seconds_seen)
            self._worker_seconds_seen = worker_seconds
        self.queue_length.labels(m).set(queue_length)
        self.budget_reserved.labels(m).set(reserved)
        self.dispatcher_alive.labels(m).set(int(dispatcher_alive))
        self.open_charges.labels(m).set(open_charges)
        self.slots_in_use.labels(m).set(sum(w.num_inflight for w in workers))
        running = waiting = alive = restarts = 0
        for w in workers:
            s = w.stats
            running += s.get("running", 0)
            waiting += s.get("waiting", 0)
            alive += int(w.alive)
            restarts += w.restarts
            total = s.get("kv_blocks_total") or 0
            idx = str(w.index)
            self.kv_usage.labels(m, idx).set(s.get("kv_blocks_used", 0) / total if total else 0)
            self.prefix_queries.follow((m, idx), s.get("prefix_queries", 0))
            self.prefix_hits.follow((m, idx), s.get("prefix_hits", 0))
            self.spec_drafts.follow((m, idx), s.get("spec_drafts", 0))
            self.spec_draft_tokens.follow((m, idx), s.get("spec_draft_tokens", 0))
            self.spec_accepted.follow((m, idx), s.get("spec_accepted_tokens", 0))
            for pos, n in enumerate(s.get("spec_accepted_per_pos", [])):
                self.spec_per_pos.follow((m, idx, str(pos)), n)
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting + queue_length)
        self.workers_alive.labels(m).set(alive)
        self.workers.labels(m).set(len(workers))
        self.worker_restarts.labels(m).set(restarts)

    def forget_worker(self, index: int) -> None:
        """A worker left the pool for good: its per-worker series go with it."""
        key = (self.model, str(index))
        try:
            self.kv_usage.remove(*key)
        except KeyError:
            pass
        for follower in (self.prefix_queries, self.prefix_hits, self.spec_drafts,
                         self.spec_draft_tokens, self.spec_accepted, self.spec_per_pos):
            for seen in [k for k in follower.last if k[:2] == key]:
                del follower.last[seen]
                try:
                    follower.counter.remove(*seen)
                except KeyError:
                    pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
