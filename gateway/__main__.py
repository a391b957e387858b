"""`python -m gateway`: serve the OpenAI-compatible API (see --help).

SIGTERM (or SIGINT) drains: new requests get 503 and /ready turns 503 at once, requests in
flight may finish within `drain_timeout_seconds`, then the workers close, the ledger is
flushed and the process exits 0. A second signal aborts at once: workers are killed, the
rows already settled are flushed, and the process exits 1. SIGHUP rereads the key file.
With `--gateways N` (N > 1) this process supervises N gateways instead
(gateway/supervisor.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop
from aiohttp import web

from billing.key_reload import KeyReloader
from contract.errors import ModelLoadError
from contract.gc_tuning import tune_gc_for_serving
from contract.model_files import check_model_path, default_model_path
from gateway.app import create_app
from gateway.config import load_config
from gateway.http.connection import GatewayRunner
from gateway.state import STATE, GatewayState

log = logging.getLogger("gateway")


class Shutdown:
    """Counts termination signals: the first asks for a drain, the second for an abort."""

    def __init__(self):
        self.signals = 0
        self.requested = asyncio.Event()
        self.abort = asyncio.Event()

    def __call__(self, signum: int) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("signal %d: draining (again to abort)", signum)
            self.requested.set()
        else:
            log.warning("signal %d again: aborting", signum)
            self.abort.set()


async def serve(config) -> int:
    app = create_app(config)
    state = app[STATE]
    shutdown = Shutdown()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown, sig)
    if config.keys_file:  # without one, SIGHUP keeps its default action
        reloader = KeyReloader(state, config.keys_file, state.served_names)
        loop.add_signal_handler(signal.SIGHUP, reloader)
    runner = GatewayRunner(app, header_timeout=config.header_timeout_seconds,
                           keepalive_timeout=config.idle_timeout_seconds,
                           handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    unloadable = asyncio.create_task(_until_unloadable(state))
    if config.reuse_port:
        serving = asyncio.create_task(_until_serving(state, shutdown))
        await asyncio.wait({unloadable, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not unloadable.done() and not serving.result():
            unloadable.cancel()
            await runner.cleanup()  # asked to stop before it could serve
            return 0
    if not unloadable.done():
        site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port)
        await site.start()
        tune_gc_for_serving()
        log.info("listening on http://%s:%d", config.host, config.port)
        requested = asyncio.create_task(shutdown.requested.wait())
        await asyncio.wait({unloadable, requested}, return_when=asyncio.FIRST_COMPLETED)
    if unloadable.done():  # no worker can load the model: one line, no restarts, exit 1
        print(unloadable.result(), file=sys.stderr, flush=True)
        _kill_workers(state)
        await runner.cleanup()
        return 1
    unloadable.cancel()
    state.draining = True  # 503 for new requests, /ready 503
    aborted = not await _drain(state, shutdown, config.drain_timeout_seconds)
    if aborted:
        _kill_workers(state)  # in-flight requests end with an error event at once
    cleanup = asyncio.create_task(runner.cleanup())  # closes workers, flushes the ledger
    done, _ = await asyncio.wait({cleanup, asyncio.create_task(shutdown.abort.wait())},
                                 return_when=asyncio.FIRST_COMPLETED)
    if cleanup not in done:  # a second signal during the cleanup: stop waiting for workers
        aborted = True
        _kill_workers(state)
        await cleanup
    log.info("stopped (%s)", "aborted" if aborted else "drained")
    return 1 if aborted else 0


async def _until_serving(state: GatewayState, shutdown: Shutdown) -> bool:
    """A fleet child joins the shared port only once a worker is ready, so the kernel never
    hands a connection to a child that would answer 503 (a restarted one, in particular).
    False when a signal came first."""
    while state.service is None or not any(w.alive for w in state.workers):
        if shutdown.requested.is_set():
            return False
        await asyncio.sleep(0.05)
    return True


async def _until_unloadable(state: GatewayState) -> str:
    """The first ModelLoadError line, once every worker failed to load its model on its first
    start (gateway/workers/handle.py does not restart those); never returns otherwise."""
    reported: set[int] = set()
    while True:
        await asyncio.sleep(0.05)
        workers = list(state.workers)
        errors = [getattr(w, "load_error", None) for w in workers]
        if workers and state.service is None and all(errors) \
                and not any(w.info is not None for w in workers):
            return str(errors[0])
        if state.service is not None:  # others serve: say so once for each that cannot
            for w, error in zip(workers, errors):
                if error and w.index not in reported:
                    reported.add(w.index)
                    log.error("worker %d cannot load its model (not restarted): %s",
                              w.index, error)


class _LoadErrorsReportedOnce(logging.Filter):
    """The gateway reports a worker's ModelLoadError itself, as one line: drop log records
    that carry one (the start-up path logs the exception it caught)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, ModelLoadError) for a in args)


def check_model(config) -> str | None:
    """Why the configured model cannot be loaded (one line), or None: checked before any
    worker starts, without importing torch. Skipped where no local worker loads it."""
    if config.fake or config.ray_address or config.workers <= 0:
        return None
    try:
        path = config.model or default_model_path()
        check_model_path(path)
    except ModelLoadError as exc:
        return f"--model {exc}" if config.model else str(exc)
    return None


def _kill_workers(state: GatewayState) -> None:
    state.stop.set()  # no supervisor restarts them
    for w in state.workers:
        w.kill()


async def _drain(state: GatewayState, shutdown: Shutdown, timeout: float) -> bool:
    """Wait for in-flight requests to finish; False if a second signal came first."""
    idle = asyncio.create_task(state.idle.wait())
    abort = asyncio.create_task(shutdown.abort.wait())
    done, pending = await asyncio.wait({idle, abort}, timeout=timeout,
                                       return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    if abort in done:
        return False
    if idle not in done:
        log.warning("drain timeout: %d requests still in flight are cut",
                    state.active_requests)
    return True


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    config = load_config(argv)
    if (problem := check_model(config)) is not None:
        print(problem, file=sys.stderr)
        return 1
    for handler in logging.getLogger().handlers:
        handler.addFilter(_LoadErrorsReportedOnce())
    if config.gateways > 1:
        from gateway.supervisor import run_fleet
        return run_fleet(config)
    try:
        return uvloop.run(serve(config))
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
