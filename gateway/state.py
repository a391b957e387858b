"""Everything the gateway shares between handlers, kept under one aiohttp AppKey."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from billing.keys import KeyStore
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.openai.reasoning import resolve_parser
from gateway.openai.tool_parsers import resolve as resolve_tool_parser
from gateway.serving.accounting import Accounting
from gateway.serving.batch_view import BatchTierView
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightTable
from gateway.serving.queue import RequestQueue
from gateway.serving.response_store import ResponseStore
from gateway.serving.service import GenerationService
from gateway.telemetry.feed import FeedHub
from gateway.telemetry.loop_lag import LoopLag
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.snapshot import SnapshotBuilder
from gateway.telemetry.spans import Telemetry
from gateway.workers.handle import WorkerHandle


@dataclass
class GatewayState:
    """The parts built at start (all of them: none is filled in later), what the first ready
    worker tells (the service, the metrics, the model's facts), and the lifecycle flags."""

    config: GatewayConfig
    workers: list[WorkerHandle]  # the very list the dispatcher places jobs from
    queue: RequestQueue
    inflight: InFlightTable  # every request in flight
    dispatcher: Dispatcher
    accounting: Accounting
    feed: FeedHub
    response_store: ResponseStore  # /v1/responses kept for previous_response_id
    served_names: tuple[str, ...]  # every name clients may ask for (--served-model-name)
    keys: KeyStore | None = None  # None: single-tenant development mode; SIGHUP swaps it
    telemetry: Telemetry | None = None  # when enabled
    batch: BatchTierView | None = None  # the Batch API's idle-capacity runner, when on
    # from the first worker ready: until then requests get 503 (require_service)
    service: GenerationService | None = None
    metrics: GatewayMetrics | None = None
    model_root: str = "unknown"  # what the worker loaded (its file's name)
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request omits
    model_name: str = field(init=False)  # the name reported: the first of served_names
    snapshots: SnapshotBuilder = field(init=False)  # the live feed's gauges, read from here
    started_at: float = field(default_factory=time.time)
    loop_lag: LoopLag = field(default_factory=LoopLag)  # how long the event loop was held
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    open_responses: set = field(default_factory=set)  # streams to close on shutdown
    draining: bool = False  # SIGTERM received: admit nothing new, let in-flight finish
    active_requests: int = 0  # generation handlers running (HTTP and WebSocket requests)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while none is active
    _reasoning_parser: str | None = field(default=None, init=False, repr=False)
    _tool_call_parser: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.model_name = self.served_names[0]
        self.snapshots = SnapshotBuilder(self)
        self.idle.set()

    def request_started(self) -> None:
        self.active_requests += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.active_requests -= 1
        if self.active_requests <= 0:
            self.idle.set()

    def reasoning_parser(self) -> str:
        """The reasoning parser of chat answers (gateway/openai/reasoning.py): the one
        --reasoning-parser names, or with `auto` the one the model's chat template calls
        for, read once the first worker told it."""
        if self._reasoning_parser is None:
            tokenizer = getattr(self.service, "tokenizer", None)
            template = getattr(tokenizer, "chat_template", None)
            parser = resolve_parser(getattr(self.config, "reasoning_parser", "auto"), template)
            if self.service is None:
                return parser  # not yet known for good
            self._reasoning_parser = parser
        return self._reasoning_parser

    def tool_call_parser(self) -> str:
        """The tool-call syntax tool_choice auto reads (gateway/openai/tool_parsers/): the one
        --tool-call-parser names, or with `auto` the family the model's chat template names,
        read once the first worker told it."""
        if self._tool_call_parser is None:
            tokenizer = getattr(self.service, "tokenizer", None)
            template = getattr(tokenizer, "chat_template", None)
            parser = resolve_tool_parser(getattr(self.config, "tool_call_parser", "auto"),
                                         template)
            if self.service is None:
                return parser  # not yet known for good
            self._tool_call_parser = parser
        return self._tool_call_parser

    def require_service(self) -> GenerationService:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           "server_error", code="shutting_down", headers={"Retry-After": "5"})
        if self.service is None or not any(w.alive for w in self.workers):
            raise APIError(503, "no worker is ready yet; retry shortly", "server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        return self.service


STATE = web.AppKey("gateway_state", GatewayState)
