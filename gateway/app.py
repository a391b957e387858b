"""The aiohttp application factory and the lifecycle of workers and background tasks."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

from aiohttp import web

from billing.pricing import PriceBook
from billing.store_factory import budget_store, limit_store
from contract.errors import StartError, one_line
from contract.frames import KvEvents, Output, Ready, TransferDone
from contract.tokenizer import Tokenizer
from gateway.batch.runner import BATCH, BatchRunner, owner_name, settings_of
from gateway.batch.store import BatchStore, open_backend
from gateway.config import GatewayConfig
from gateway.http.auth import presented_key, serving_keys
from gateway.http.browser_guard import browser_guard
from gateway.http.error_middleware import error_middleware
from gateway.http.routes import add_routes
from gateway.serving.accounting import Accounting
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightTable
from gateway.serving.queue import RequestQueue
from gateway.serving.response_store import ResponseStore
from gateway.serving.service import GenerationService
from gateway.state import STATE, GatewayState
from gateway.telemetry import access_log
from gateway.telemetry.feed import FeedHub
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.otlp_metrics import push_loop
from gateway.telemetry.spans import Telemetry
from gateway.workers.handle import WorkerEvents, WorkerHandle, supervise
from gateway.workers.ray_handle import RayWorkerHandle
from gateway.workers.remote_handle import remote_worker_handles

log = logging.getLogger(__name__)
KV_STORE = web.AppKey("kv_store", object)  # the TCPStore of KV-transfer groups (PD mode)
KV_METRICS = web.AppKey("kv_metrics", dict)  # "seconds" histogram, "bytes" counter (PD)


def create_app(config: GatewayConfig, in_memory_spans: bool = False) -> web.Application:
    """The gateway. `in_memory_spans` keeps finished spans for tests to read."""
    middlewares = [error_middleware]
    if not (config.keys_file or config.api_key):  # every caller is admin: keep web pages out
        middlewares.append(browser_guard(check_host=config.is_loopback()))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    served_names = config.served_names()
    queue, inflight = RequestQueue(config.max_queue, config.aging_seconds), InFlightTable()
    if config.ray_address:
        _connect_ray(config)
    workers, dispatcher = _create_workers(app, config, queue, inflight, GatewayWorkerEvents(app))
    accounting = Accounting(
        inflight, PriceBook.load(config.prices),
        budget_store(config.resolved_ledger_path(), config.state_url),
        limit_store(config.fair_share_tokens_per_second, config.redis_url))
    feed = FeedHub()
    telemetry = Telemetry(otlp_endpoint=config.otlp_endpoint, in_memory=in_memory_spans,
                          publish=feed.add_span) if config.telemetry else None
    state = GatewayState(
        config, workers, queue, inflight, dispatcher, accounting, feed,
        ResponseStore(config.responses_store_seconds, config.responses_store_max), served_names,
        keys=serving_keys(config.keys_file, config.api_key, served_names),
        telemetry=telemetry)
    if config.batch_api:  # files and batches beside the ledger (or in its PostgreSQL)
        ledger_path = config.resolved_ledger_path()
        runner = BatchRunner(state, BatchStore(open_backend(ledger_path, config.state_url)),
                             settings_of(config), owner_name(ledger_path))
        state.batch = app[BATCH] = runner
    accounting.subscribe(state.snapshots.on_settled)
    if telemetry is not None:
        accounting.subscribe(telemetry.request_finished)
    access_log.install(app, state, presented_key)
    app[STATE] = state
    if config.reuse_port:  # a fleet child: say which of them answered (tests, operators)
        app.on_response_prepare.append(_tag_instance)
    add_routes(app)
    app.cleanup_ctx.append(_lifecycle)
    return app


class GatewayWorkerEvents(WorkerEvents):
    """What every worker handle reports, and where it goes in the gateway."""

    def __init__(self, app: web.Application):
        self.app = app

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]  # set before any worker starts, so before any event

    def ready(self, worker: WorkerHandle) -> None:
        _on_worker_ready(self.app, self.state, worker)

    def output(self, worker: WorkerHandle, out: Output) -> None:
        self.state.accounting.on_output(out)  # before the client's stream sees it
        if out["finished"]:
            self.state.dispatcher.notify()  # a slot is free

    def prefilled(self, worker: WorkerHandle, out: Output) -> None:
        self.state.dispatcher.handoff(worker, out)

    def transferred(self, worker: WorkerHandle, done: TransferDone) -> None:
        _on_transfer(self.app, done)

    def on_kv_events(self, worker: WorkerHandle, frame: KvEvents) -> None:
        self.state.dispatcher.on_kv_events(worker, frame)


def _remote_workers(config: GatewayConfig, events: WorkerEvents,
                    first_index: int) -> list[WorkerHandle]:
    """Handles of the shared workers at --worker-url, numbered after this gateway's own."""
    try:
        return list(remote_worker_handles(config.worker_urls, events, first_index,
                                          config.worker_ready_timeout))
    except ValueError as exc:  # a malformed URL stops the start, not the first request
        raise SystemExit(f"--worker-url: {exc}") from None


# random, not the pid: process ids are for operators only (/ready shows them to admins)
_INSTANCE = secrets.token_hex(6)


async def _tag_instance(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-gateway-instance"] = _INSTANCE


def _create_workers(app: web.Application, config: GatewayConfig, queue: RequestQueue,
                    inflight: InFlightTable, events: WorkerEvents
                    ) -> tuple[list[WorkerHandle], Dispatcher]:
    """The worker handles (started later) and the dispatcher placing jobs on them."""
    if config.pd_split():
        return _create_pd_workers(app, config, queue, inflight, events)
    workers = [_worker(config, i, config.worker_argv(), events) for i in range(config.workers)]
    workers += _remote_workers(config, events, len(workers))
    return workers, Dispatcher(workers, queue, inflight, config.affinity_margin,
                               tenant_max_running_share=config.tenant_max_running_share)


def _create_pd_workers(app: web.Application, config: GatewayConfig, queue: RequestQueue,
                       inflight: InFlightTable, events: WorkerEvents
                       ) -> tuple[list[WorkerHandle], Dispatcher]:
    """P prefill then D decode workers, joined for KV transfers by a TCPStore served here
    on loopback only (or on a Ray node), their groups keyed by a secret made at each start."""
    from runtime.transport.kv_rendezvous import SECRET_ENV, SECRET_FLAG, new_secret, serve_store
    num_prefill, num_decode = config.pd_split()
    app[KV_METRICS] = {}
    secret, env = new_secret(), None
    if config.ray_address:
        address = _ray_kv_store(app)
        extra = [SECRET_FLAG, secret]  # an actor's argv is a Ray call argument, not in `ps`
    else:
        store = serve_store("127.0.0.1", config.kv_store_port)
        app[KV_STORE] = store
        address = f"127.0.0.1:{store.port}"
        extra, env = [], {SECRET_ENV: secret}  # in the environment, not on a command line
    argv = config.worker_argv() + ["--kv-store", address]
    workers = [_worker(config, i, argv + extra, events, env)
               for i in range(num_prefill + num_decode)]
    return workers, Dispatcher(workers[:num_prefill], queue, inflight, config.affinity_margin,
                               workers[num_prefill:],
                               tenant_max_running_share=config.tenant_max_running_share)


def _worker(config: GatewayConfig, index: int, argv: list[str], events: WorkerEvents,
            env: dict | None = None) -> WorkerHandle:
    if config.ray_address:
        gpus = 1 if config.engine.device.startswith("cuda") else 0
        return RayWorkerHandle(index, argv, config.worker_ready_timeout,
                               num_cpus=config.threads(), num_gpus=gpus, events=events)
    return WorkerHandle(index, argv, env=env, ready_timeout=config.worker_ready_timeout,
                        events=events)


def _connect_ray(config: GatewayConfig) -> None:
    """Join the Ray cluster; actors import this repository from the same path on every node.
    Without ray installed, or with no cluster at the address, the start stops with one line."""
    try:
        import ray
    except ImportError as exc:
        raise StartError("--ray-address needs ray, which is not installed: pip install -e "
                         "'.[ray]' (or leave --ray-address out to run workers here)") from exc
    if ray.is_initialized():
        return
    check_ray_cluster(config.ray_address)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0"}
    for name in ("INFERSTACK_CACHE_DIR", "TRITON_INTERPRET"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    try:
        ray.init(address=config.ray_address, namespace="inferstack", log_to_driver=False,
                 runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError, ValueError) as exc:  # no cluster there, a bad address
        raise StartError(f"--ray-address {config.ray_address}: cannot join the Ray cluster "
                         f"({one_line(exc)})") from exc


RAY_JOIN_SECONDS = 30.0  # a cluster started with the gateway (compose, a test) comes up meanwhile


def check_ray_cluster(address: str, patience: float = RAY_JOIN_SECONDS) -> None:
    """ray.init waits more than a minute on an address where no cluster answers (printing its
    own warnings meanwhile): TCP connections to the cluster's address, tried for `patience`
    seconds, decide first. Ray Client addresses (ray://) and "local" (a new cluster) are left
    to Ray."""
    if address.startswith("ray://") or address == "local":
        return
    from ray._private.services import canonicalize_bootstrap_address_or_die
    deadline = time.monotonic() + patience
    while True:
        try:
            host, port = canonicalize_bootstrap_address_or_die(address).rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=2.0).close()
            return
        except (OSError, ValueError) as exc:  # ConnectionError: no cluster found for "auto"
            if time.monotonic() >= deadline:
                raise StartError(f"--ray-address {address}: no Ray cluster answers there "
                                 f"({one_line(exc)}); start one (ray start --head) or fix the "
                                 f"address") from exc
        time.sleep(0.5)


def _ray_kv_store(app: web.Application) -> str:
    """The KV-transfer rendezvous through Ray: a TCPStore hosted by an actor on the cluster."""
    import ray

    from runtime.transport.ray_worker import KVStoreHost
    host = ray.remote(KVStoreHost).options(num_cpus=0).remote()
    app[KV_STORE] = host
    return str(ray.get(host.get_address.remote(), timeout=120))  # type: ignore[attr-defined]


def _on_transfer(app: web.Application, done: TransferDone) -> None:
    """A decode worker finished receiving a request's prompt KV."""
    metrics = app.get(KV_METRICS)
    if metrics:
        metrics["seconds"].observe(done.seconds)
        metrics["bytes"].inc(done.bytes)


async def _lifecycle(app: web.Application):
    state = app[STATE]
    await state.accounting.start()  # shared stores connect lazily: this never waits on them
    tasks = [asyncio.create_task(_start_workers(state), name="start-workers"),
             asyncio.create_task(state.dispatcher.run(state.stop), name="dispatcher"),
             asyncio.create_task(_feed_loop(state), name="feed"),
             asyncio.create_task(state.loop_lag.run(state.stop), name="loop-lag"),
             *access_log.summary_task(app, state.stop)]
    if BATCH in app:
        tasks.append(asyncio.create_task(app[BATCH].run(state.stop), name="batch-runner"))
    if state.config.otlp_endpoint:
        tasks.append(asyncio.create_task(push_loop(
            lambda: state.metrics.registry if state.metrics else None,
            state.config.otlp_endpoint, state.stop, state.config.otlp_interval_seconds)))
    yield
    if BATCH in app:  # while workers still run: its lines finish or are aborted and billed
        await app[BATCH].close()
    state.stop.set()
    for response in list(state.open_responses):
        response.force_close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(w.close() for w in state.workers), return_exceptions=True)
    await state.accounting.close()  # the ledger's last rows; shared stores' last retries
    if state.telemetry is not None:
        await asyncio.to_thread(state.telemetry.shutdown)  # exporters may post to this loop


async def _start_workers(state: GatewayState) -> None:
    """Start every worker; the first one ready provides the tokenizer and model facts."""
    async def start(w: WorkerHandle):
        try:
            await w.start()
        except StartError:  # reported once by the gateway (gateway/__main__.py), not retried
            pass
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


def _on_worker_ready(app: web.Application, state: GatewayState,
                     worker: WorkerHandle) -> None:
    if state.service is None:
        _become_ready(state, worker.info)
        if state.dispatcher.disaggregated:
            from prometheus_client import Counter, Histogram
            r = state.metrics.registry
            app[KV_METRICS].update(
                seconds=Histogram("inferstack:kv_transfer_seconds",
                                  "Prompt KV moved from a prefill to a decode worker, per "
                                  "request", registry=r,
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                           2.5)),
                bytes=Counter("inferstack:kv_transfer_bytes",
                              "Prompt KV bytes moved between workers", registry=r))
    state.dispatcher.notify()


def _become_ready(state: GatewayState, info: Ready) -> None:
    tokenizer = Tokenizer.from_json(info.tokenizer)
    state.model_root = info.model
    state.sampling_defaults = state.config.sampling_spec().resolve(info.sampling_defaults)
    state.accounting.model = state.model_name
    state.metrics = GatewayMetrics(state.model_name)
    state.loop_lag.register(state.metrics.registry)
    state.accounting.subscribe(state.metrics.observe_settled)
    state.service = GenerationService(tokenizer, state.dispatcher, state.inflight,
                                      info.max_model_len, info.vocab_size,
                                      state.config.default_max_tokens, state.accounting,
                                      state.config.stream_buffer_bytes)
    log.info("serving %s as %s from %d worker(s), sampling defaults %s", info.model,
             ", ".join(state.served_names), len(state.workers), state.sampling_defaults or
             "OpenAI's")
