"""Everything the gateway shares between handlers, kept under one aiohttp AppKey."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from billing.keys import KeyStore
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.serving.accounting import Accounting
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightTable
from gateway.serving.queue import RequestQueue
from gateway.serving.response_store import ResponseStore
from gateway.serving.service import GenerationService
from gateway.telemetry.feed import FeedHub
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.snapshot import SnapshotBuilder
from gateway.telemetry.spans import Telemetry
from gateway.workers.handle import WorkerHandle


@dataclass
class GatewayState:
    config: GatewayConfig
    workers: list[WorkerHandle] = field(default_factory=list)
    queue: RequestQueue | None = None
    inflight: InFlightTable = field(default_factory=InFlightTable)  # every request in flight
    dispatcher: Dispatcher | None = None
    service: GenerationService | None = None
    metrics: GatewayMetrics | None = None
    keys: KeyStore | None = None  # None: single-tenant development mode
    accounting: Accounting | None = None
    telemetry: Telemetry | None = None  # when enabled
    feed: FeedHub | None = None
    snapshots: SnapshotBuilder | None = None
    response_store: ResponseStore | None = None  # /v1/responses kept for previous_response_id
    model_name: str = "unknown"  # the name reported: the first of served_names
    served_names: tuple[str, ...] = ()  # every name clients may ask for (--served-model-name)
    model_root: str = "unknown"  # what the worker loaded (its file's name)
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request omits
    started_at: float = field(default_factory=time.time)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    open_responses: set = field(default_factory=set)  # streams to close on shutdown
    draining: bool = False  # SIGTERM received: admit nothing new, let in-flight finish
    active_requests: int = 0  # generation handlers running (HTTP and WebSocket requests)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while none is active

    def __post_init__(self) -> None:
        self.idle.set()

    def request_started(self) -> None:
        self.active_requests += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.active_requests -= 1
        if self.active_requests <= 0:
            self.idle.set()

    def require_service(self) -> GenerationService:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           "server_error", code="shutting_down", headers={"Retry-After": "5"})
        if self.service is None or not any(w.alive for w in self.workers):
            raise APIError(503, "no worker is ready yet; retry shortly", "server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        return self.service


STATE = web.AppKey("gateway_state", GatewayState)
