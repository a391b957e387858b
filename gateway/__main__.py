"""`python -m gateway`: serve the OpenAI-compatible API (see --help).

SIGTERM (or SIGINT) drains: new requests get 503 and /ready turns 503 at once, requests in
flight may finish within `drain_timeout_seconds`, then the workers close, the ledger is
flushed and the process exits 0. A second signal aborts at once: workers are killed, the
rows already settled are flushed, and the process exits 1. SIGHUP rereads the key file.
With `--gateways N` (N > 1) this process supervises N gateways instead
(gateway/supervisor.py).

Whatever stops the start (a setting, a file, a port, a store, a worker that cannot start) is
one line on stderr and exit status 1; --debug adds the traceback.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import traceback
from urllib.parse import urlsplit

import uvloop
from aiohttp import web

from billing.key_reload import KeyReloader
from billing.keys import KeyFileError
from billing.pricing import PRESETS, PriceBookError
from contract.engine_settings import check_on_this_host, check_writable_folder
from contract.errors import LOG_FORMAT, ModelLoadError, StartError, one_line
from contract.gc_tuning import tune_gc_for_serving
from contract.model_files import check_model_path, default_model_path
from gateway.app import create_app
from gateway.config import GatewayConfig, debug_requested, listen_problem, load_config
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
    app = _create_app(config)
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
    unstartable = asyncio.create_task(_until_unstartable(state))
    if config.reuse_port:
        serving = asyncio.create_task(_until_serving(state, shutdown))
        await asyncio.wait({unstartable, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not unstartable.done() and not serving.result():
            unstartable.cancel()
            await runner.cleanup()  # asked to stop before it could serve
            return 0
    if not unstartable.done():
        await _listen(config, state, runner)
        tune_gc_for_serving()
        log.info("listening on http://%s:%d", config.host, config.port)
        requested = asyncio.create_task(shutdown.requested.wait())
        await asyncio.wait({unstartable, requested}, return_when=asyncio.FIRST_COMPLETED)
    if unstartable.done():  # no worker can start: one line, no restarts, exit 1
        _kill_workers(state)
        await runner.cleanup()
        raise StartError(unstartable.result())
    unstartable.cancel()
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


def _create_app(config: GatewayConfig) -> web.Application:
    """The app, or a StartError: any error building it (a key or price file, a ledger, a
    store's URL, Ray) stops the start, and one whose kind has no clearer line of its own is
    named by its type and message."""
    try:
        return create_app(config)
    except KeyFileError as exc:  # its line names the file: say which flag gave it
        raise StartError(f"--keys-file {exc}") from exc
    except PriceBookError as exc:
        raise StartError(f"--prices {one_line(exc)} (a preset: {', '.join(PRESETS)}; or a "
                         f"price-book TOML file)") from exc
    except (StartError, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - every kind becomes one line (--debug: traceback)
        raise StartError(f"cannot start: {type(exc).__name__}: {one_line(exc)}") from exc


async def _listen(config: GatewayConfig, state: GatewayState, runner: GatewayRunner) -> None:
    """Bind the port; a port in use (or any address that cannot be bound) stops the start,
    the workers already starting stopped with it."""
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port)
    try:
        await site.start()
    except OSError as exc:
        _kill_workers(state)
        await runner.cleanup()
        raise StartError(listen_problem(config.host, config.port, exc)) from exc


async def _until_serving(state: GatewayState, shutdown: Shutdown) -> bool:
    """A fleet child joins the shared port only once a worker is ready, so the kernel never
    hands a connection to a child that would answer 503 (a restarted one, in particular).
    False when a signal came first."""
    while state.service is None or not any(w.alive for w in state.workers):
        if shutdown.requested.is_set():
            return False
        await asyncio.sleep(0.05)
    return True


async def _until_unstartable(state: GatewayState) -> str:
    """The first worker's StartError line, once every worker failed to start (its model does
    not load, a setting it cannot serve) on its first start (gateway/workers/handle.py does not
    restart those); never returns otherwise."""
    reported: set[int] = set()
    while True:
        await asyncio.sleep(0.05)
        workers = list(state.workers)
        errors = [getattr(w, "start_error", None) for w in workers]
        if workers and state.service is None and all(errors) \
                and not any(w.info is not None for w in workers):
            return str(errors[0])
        if state.service is not None:  # others serve: say so once for each that cannot
            for w, error in zip(workers, errors):
                if error and w.info is None and w.index not in reported:
                    reported.add(w.index)
                    log.error("worker %d cannot start (not restarted): %s", w.index, error)


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


def check_before_workers(config: GatewayConfig) -> None:
    """What this machine cannot serve stops the start before any worker starts: the model,
    the engine settings (a CUDA device under a CPU-only torch, a disk-cache folder, a chat
    template) and the shared stores. Skipped for workers placed elsewhere."""
    if (problem := check_model(config)) is not None:
        raise StartError(problem)
    check_ledger_folder(config)
    if config.workers > 0 and not config.ray_address:
        check_on_this_host(config.engine, fake=config.fake)
    if config.state_url or config.redis_url:
        asyncio.run(check_stores(config))


def check_ledger_folder(config: GatewayConfig) -> None:
    """The ledger (with --state-url, the outbox beside it) is written by this process: its
    folder must take files."""
    flag = f"--ledger-path {config.ledger_path}: its folder" if config.ledger_path \
        else "INFERSTACK_CACHE_DIR, the ledger's folder,"
    try:
        path = config.resolved_ledger_path()  # creates the default cache folder
    except OSError as exc:
        raise StartError(f"{flag} {exc.filename}: cannot create it "
                         f"({exc.strerror or exc})") from exc
    check_writable_folder(os.path.dirname(os.path.abspath(path)), flag)


async def check_stores(config: GatewayConfig, timeout: float = 5.0) -> None:
    """--state-url and --redis-url answer now, or the start stops naming the one that does
    not (a wrong host, port or password is far likelier at start than an outage; once
    serving, an outage is refused with 503 until the store is back)."""
    if config.state_url:
        import asyncpg
        try:
            conn = await asyncpg.connect(config.state_url, timeout=timeout)
            await conn.close()
        except Exception as exc:  # noqa: BLE001 - refused, unknown host, bad password, ...
            raise _unreachable("--state-url", config.state_url, "PostgreSQL", exc) from exc
    if config.redis_url:
        import redis.asyncio as aioredis
        try:
            client = aioredis.from_url(config.redis_url, socket_connect_timeout=timeout,
                                       socket_timeout=timeout)
            try:
                await client.ping()
            finally:
                await client.aclose()
        except Exception as exc:  # noqa: BLE001 - as above
            raise _unreachable("--redis-url", config.redis_url, "Redis", exc) from exc


def _unreachable(flag: str, url: str, kind: str, exc: Exception) -> StartError:
    return StartError(f"{flag} {_without_password(url)}: cannot reach {kind} there "
                      f"({type(exc).__name__}: {one_line(exc)}); is it running, and is the URL "
                      f"right?")


def _without_password(url: str) -> str:
    """The URL as it may be printed: its password starred (never in a log)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    except ValueError:  # too malformed to split: only its scheme
        return url.split("://", 1)[0] + "://..."


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    debug = debug_requested(argv)
    try:
        return _start(argv)
    except StartError as exc:
        if debug:
            traceback.print_exc()
        print(one_line(exc), file=sys.stderr, flush=True)
        return 1
    except SystemExit as exc:  # a setting refused with its one line (argparse's, ours)
        if debug and isinstance(exc.code, str):
            traceback.print_exc()
        raise


def _start(argv: list[str] | None) -> int:
    config = load_config(argv)
    check_before_workers(config)
    if config.gateways > 1:
        from gateway.supervisor import run_fleet
        return run_fleet(config)
    try:
        return uvloop.run(serve(config))
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
