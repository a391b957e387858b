"""What the operators' routes answer, declared as TypedDicts for /openapi.json: liveness and
readiness, the ledger's totals (/admin/usage), the worker pool (/admin/workers) and the fleet
(/admin/fleet), and the body that adds a worker.

The handlers (gateway/http/routes.py, gateway/http/admin_workers.py) build these as plain
dicts; tests/gateway/test_openapi.py checks a live gateway's answers against the document.
"""
from __future__ import annotations

from typing import Literal, NotRequired

from typing_extensions import TypedDict


class Health(TypedDict):
    status: Literal["ok"]


class Readiness(TypedDict):
    """200 when a worker can take requests and the gateway is not draining, else 503."""

    ready: bool
    draining: bool
    workers_ready: int
    workers: int
    uptime_seconds: float
    worker_pids: NotRequired[list[int | None]]  # admin keys only: None for a dead worker


class LedgerTotals(TypedDict):
    """One tenant's sums over one period bucket of the ledger."""

    tenant: str
    period: str  # the bucket: "2026-12-03T14:00", "2026-12-03", "2026-12" or "all"
    requests: int
    cache_hit_tokens: int
    cache_miss_tokens: int
    output_tokens: int
    cost_cache_hit: float
    cost_cache_miss: float
    cost_output: float
    cost_total: float
    batch_requests: int  # of `requests`, Batch API lines (the batch tier)
    cost_batch: float  # of `cost_total`, what those lines cost


class PriceWindow(TypedDict):
    start_minute: int  # minutes after 00:00 UTC
    end_minute: int
    multiplier: float


class PriceBook(TypedDict):
    """$ per million tokens, and the GPU cost revenue is compared with."""

    name: str
    cache_hit_input: float
    cache_miss_input: float
    output: float
    gpu_cost_per_hour: float
    batch_multiplier: float  # Batch API lines pay this times the window's multiplier
    windows: list[PriceWindow]


class UsageReport(TypedDict):
    object: Literal["list"]
    period: Literal["hour", "day", "month", "all"]
    data: list[LedgerTotals]  # newest bucket first
    prices: PriceBook


class Worker(TypedDict):
    index: int
    kind: Literal["local", "remote"]
    url: str | None  # a remote worker's tcp://HOST:PORT
    pid: int | None
    alive: bool
    draining: bool
    running: int
    load: float  # running / max_num_seqs
    max_num_seqs: int
    restarts: int


class WorkerList(TypedDict):
    object: Literal["list"]
    data: list[Worker]


class RemovedWorker(Worker):
    removed: bool  # false: draining (202); true: gone (200, with ?wait=true)


class AddRemoteWorker(TypedDict):
    url: str  # tcp://HOST:PORT of a `python -m runtime serve`


class SpawnWorker(TypedDict):
    spawn: Literal[True]


AddWorkerRequest = AddRemoteWorker | SpawnWorker


class FleetGateway(TypedDict):
    id: str
    address: str
    pid: int
    started_at: float
    heartbeat: float
    draining: bool
    queue: int
    running: int
    workers: list[Worker]


class FleetWorker(Worker):
    gateway: str | None  # the id of the gateway it serves


class FleetTotals(TypedDict):
    """Sums over the whole ledger: every gateway's with a shared one (--state-url)."""

    requests: int
    cache_hit_tokens: float
    cache_miss_tokens: float
    output_tokens: float
    cost_cache_hit: float
    cost_cache_miss: float
    cost_output: float
    cost_total: float
    cache_hit_rate: float


class Fleet(TypedDict):
    gateways: list[FleetGateway]
    workers: list[FleetWorker]
    totals: FleetTotals
    ledger: Literal["shared", "this gateway's"]
    registry: Literal["redis", "none"]


# the component schemas of the OpenAPI document, by name
COMPONENTS = {"Health": Health, "Readiness": Readiness, "UsageReport": UsageReport,
              "WorkerList": WorkerList, "Worker": Worker, "RemovedWorker": RemovedWorker,
              "AddWorkerRequest": AddWorkerRequest, "Fleet": Fleet}
