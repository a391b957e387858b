"""The aiohttp application factory and the lifecycle of workers and background tasks."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from gateway.accounting import Accounting
from gateway.config import GatewayConfig
from gateway.fairshare import FairShare
from gateway.feed import FeedHub
from gateway.otlp_metrics import push_loop
from gateway.snapshot import SnapshotBuilder
from gateway.telemetry import Telemetry
from gateway.keys import KeyStore
from gateway.ledger import Ledger
from gateway.pricing import PRESETS, PriceBook
from gateway.dispatch import Dispatcher
from gateway.http_errors import error_middleware
from gateway.metrics import GatewayMetrics
from gateway.queue import RequestQueue
from gateway.routes import add_routes
from gateway.service import GenerationService
from gateway.state import STATE, GatewayState
from gateway.worker_client import WorkerHandle, supervise
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def create_app(config: GatewayConfig, in_memory_spans: bool = False) -> web.Application:
    """The gateway. `in_memory_spans` keeps finished spans for tests to read."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware])
    state = GatewayState(config)
    state.queue = RequestQueue(config.max_queue, config.aging_seconds)
    state.workers = [WorkerHandle(i, config.worker_argv(),
                                  ready_timeout=config.worker_ready_timeout)
                     for i in range(config.workers)]
    state.dispatcher = Dispatcher(state.workers, state.queue, config.affinity_margin)
    state.keys = KeyStore.from_toml(config.keys_file) if config.keys_file else None
    state.accounting = Accounting(load_prices(config.prices),
                                  Ledger(config.resolved_ledger_path()),
                                  FairShare(config.fair_share_tokens_per_second))
    state.feed = FeedHub()
    state.snapshots = SnapshotBuilder(state)
    state.accounting.on_settle.append(state.snapshots.on_settled)
    if config.telemetry:
        state.telemetry = Telemetry(otlp_endpoint=config.otlp_endpoint,
                                    in_memory=in_memory_spans, publish=state.feed.add_span)
        state.accounting.on_settle.append(state.telemetry.request_finished)
    app[STATE] = state
    add_routes(app)
    app.cleanup_ctx.append(_lifecycle)
    return app


async def _lifecycle(app: web.Application):
    state = app[STATE]
    for w in state.workers:
        w.on_output = lambda worker, out: _on_output(state, out)
        w.on_ready = lambda worker: _on_worker_ready(state, worker)
    tasks = [asyncio.create_task(_start_workers(state), name="start-workers"),
             asyncio.create_task(state.dispatcher.run(state.stop), name="dispatcher"),
             asyncio.create_task(_feed_loop(state), name="feed")]
    if state.config.otlp_endpoint:
        tasks.append(asyncio.create_task(push_loop(
            lambda: state.metrics.registry if state.metrics else None,
            state.config.otlp_endpoint, state.stop, state.config.otlp_interval_seconds)))
    yield
    state.stop.set()
    for response in list(state.open_responses):
        response.force_close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(w.close() for w in state.workers), return_exceptions=True)
    if state.accounting.ledger is not None:
        state.accounting.ledger.close()
    if state.telemetry is not None:
        await asyncio.to_thread(state.telemetry.shutdown)  # exporters may post to this loop


async def _start_workers(state: GatewayState) -> None:
    """Start every worker; the first one ready provides the tokenizer and model facts."""
    async def start(w: WorkerHandle):
        try:
            await w.start()
        except Exception as exc:  # noqa: BLE001 - the supervisor retries
            log.error("worker %d failed to start: %s", w.index, exc)

    supervisors = [asyncio.create_task(supervise(w, state.stop)) for w in state.workers]
    await asyncio.gather(*(start(w) for w in state.workers))
    try:
        await asyncio.gather(*supervisors)
    finally:
        for s in supervisors:
            s.cancel()


async def _feed_loop(state: GatewayState, tick: float = 0.25) -> None:
    """Spans out every tick, a gauge snapshot every second, to live-feed subscribers."""
    resource = {"attributes": [{"key": "service.name",
                                "value": {"stringValue": "inferstack-gateway"}}]}
    ticks = 0
    while not state.stop.is_set():
        await asyncio.sleep(tick)
        ticks += 1
        state.feed.flush_spans(resource)
        if ticks % round(1 / tick) == 0 and state.feed.subscribers:
            state.feed.publish(state.snapshots.build())


def _on_output(state: GatewayState, out: dict) -> None:
    if out["finished"]:
        state.accounting.on_output(out)  # before the client's stream sees the final output
        state.dispatcher.notify()  # a slot is free


def load_prices(spec: str) -> PriceBook:
    return PriceBook.preset(spec) if spec in PRESETS else PriceBook.from_toml(spec)


def _on_worker_ready(state: GatewayState, worker: WorkerHandle) -> None:
    if state.service is None:
        _become_ready(state, worker.info)
    state.dispatcher.notify()


def _become_ready(state: GatewayState, info: dict) -> None:
    tokenizer = Tokenizer.from_json(info["tokenizer"])
    state.model_name = info["model"]
    state.accounting.model = info["model"]
    state.metrics = GatewayMetrics(info["model"])
    state.accounting.on_settle.append(state.metrics.observe_settled)
    state.service = GenerationService(tokenizer, state.dispatcher, info["max_model_len"],
                                      info["vocab_size"], state.config.default_max_tokens,
                                      state.accounting)
    log.info("serving %s from %d worker(s)", info["model"], len(state.workers))
