"""`python -m gateway --gateways N`: N gateway processes on one host and port, over workers
they share.

The engine workers (`--workers`, with the engine flags) start once, as `python -m runtime
serve` on free loopback ports; once each listens, N gateways start on the same host and port
with SO_REUSEPORT, so the kernel spreads connections across them. Each gateway gets
`--workers 0` and every shared worker (plus any --worker-url given) and otherwise the same
settings, passed in its environment so that no secret (a --state-url password) shows in `ps`,
and its own ledger path (its PostgreSQL outbox is a file of its own). Budgets and limits hold
across the gateways only through PostgreSQL and Redis, which GatewayConfig.check_fleet
demands.

SIGTERM and SIGINT go to every gateway (drain; a second one aborts), SIGHUP too (the key file
is reread; without one it is ignored, as a gateway would die of it). A gateway or worker that
dies is started again, after a backoff when it dies young (the gateways reconnect to a worker
restarted on its port). The supervisor exits once every gateway has, stopping the workers
last; 0 when every gateway drained.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from contract.errors import StartError
from contract.frames import TOKEN_ENV
from gateway.config import GatewayConfig, flat_settings, listen_problem

log = logging.getLogger("gateway.supervisor")
MAX_BACKOFF = 10.0  # seconds between restarts of a child that keeps dying young


def run_fleet(config: GatewayConfig) -> int:
    """Serve with config.gateways gateway processes; the exit status of the fleet. The
    resolved config travels whole, whichever of flag, environment or file set each value."""
    return Fleet(config).run()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (even by SIGKILL), so that
    no gateway or worker outlives it unsupervised (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """One supervised process and when it may be started again."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        self.name, self.argv, self.env = name, argv, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.backoff = 0.5
        self.next_start = 0.0

    def start(self) -> None:
        # a group of its own: a terminal's Ctrl-C reaches the supervisor alone, which
        # forwards it once (two would abort a drain)
        self.proc = subprocess.Popen(self.argv, env=self.env, process_group=0,
                                     preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.running:
            self.proc.send_signal(signum)

    def restart_if_dead(self) -> None:
        """Start it again if it exited; a child that lived less than MAX_BACKOFF waits
        longer each time."""
        if self.proc is None or self.running:
            return
        now = time.monotonic()
        if self.next_start == 0.0:
            log.error("%s (pid %d) exited with %s; restarting", self.name, self.proc.pid,
                      self.proc.returncode)
            young = now - self.started < MAX_BACKOFF
            self.backoff = min(MAX_BACKOFF, self.backoff * 2) if young else 0.5
            self.next_start = now + (self.backoff if young else 0.0)
        if now >= self.next_start:
            self.next_start = 0.0
            self.start()


class Fleet:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.ports = [_free_port() for _ in range(config.workers)]
        token = {TOKEN_ENV: worker_token(config)}
        self.workers = [Child(f"worker {i}", _serve_argv(config, port), dict(os.environ, **token))
                        for i, port in enumerate(self.ports)]
        urls = config.worker_urls + tuple(f"tcp://127.0.0.1:{p}" for p in self.ports)
        ledger = config.resolved_ledger_path()
        self.gateways = [
            Child(f"gateway {i}", [sys.executable, "-m", "gateway"],
                  child_environ(config, gateways=1, workers=0, worker_urls=urls,
                                reuse_port=True, ledger_path=f"{ledger}.{i}") | token)
            for i in range(config.gateways)]
        self.signals = 0

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)
        check_port(self.config.host, self.config.port)
        try:
            for w in self.workers:
                w.start()
            if not self._workers_listening():
                return 1
            for g in self.gateways:
                if not self.signals:
                    g.start()
            log.info("%d gateways on http://%s:%d over %d shared worker(s)",
                     len(self.gateways), self.config.host, self.config.port,
                     len(self.workers) + len(self.config.worker_urls))
            while not self.signals:
                for child in self.workers + self.gateways:
                    child.restart_if_dead()
                time.sleep(0.1)
            codes = [g.proc.wait() for g in self.gateways if g.proc is not None]
            return 0 if all(c == 0 for c in codes) else 1
        finally:
            self._stop_all()

    def _on_stop(self, signum: int, frame) -> None:
        self.signals += 1
        log.info("signal %d: passed to %d gateways", signum, len(self.gateways))
        for g in self.gateways:
            g.signal(signum)

    def _on_reload(self, signum: int, frame) -> None:
        if not self.config.keys_file:
            log.info("SIGHUP ignored: there is no key file to reread")
            return
        for g in self.gateways:
            g.signal(signum)

    def _workers_listening(self) -> bool:
        """Wait until every shared worker accepts connections (its model loaded)."""
        deadline = time.monotonic() + self.config.worker_ready_timeout
        for w, port in zip(self.workers, self.ports):
            while not _accepts(port):
                if not w.running or self.signals or time.monotonic() > deadline:
                    log.error("%s did not start listening on port %d%s", w.name, port,
                              f" (exit {w.proc.returncode})" if not w.running else "")
                    return False
                time.sleep(0.1)
        return True

    def _stop_all(self) -> None:
        """Gateways first (each drains over the workers), the workers last."""
        for group in (self.gateways, self.workers):
            for c in group:
                c.signal(signal.SIGTERM)
            for c in group:
                if c.proc is None:
                    continue
                try:
                    c.proc.wait(self.config.drain_timeout_seconds + 15)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()


def worker_token(config: GatewayConfig) -> str:
    """The secret the fleet's own workers demand of every connection: the operator's
    INFERSTACK_WORKER_TOKEN, else a fresh one per start (loopback is no barrier to another
    user's process on this host). With --worker-url and no token the operator's workers were
    started without one, so none is made up for them."""
    token = os.environ.get(TOKEN_ENV)
    if token or config.worker_urls:
        return token or ""
    return secrets.token_hex(32)


def child_environ(config: GatewayConfig, **changes) -> dict[str, str]:
    """This process's environment with every gateway setting of `config` (after `changes`)
    as INFERSTACK_<NAME>, so a child resolves exactly this config with no flag or file."""
    config = dataclasses.replace(config, **changes)
    env = dict(os.environ)
    for setting, value in flat_settings(config).items():
        name = "INFERSTACK_" + setting.upper()
        if value is None:
            env.pop(name, None)
        elif isinstance(value, tuple):
            env[name] = ",".join(value)
        else:
            env[name] = str(value)
    return env


def check_port(host: str, port: int) -> None:
    """The gateways share host:port (SO_REUSEPORT): a port another server holds stops the
    start now, in one line, not after the workers loaded, as gateways dying one by one."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((host, port), family=family, reuse_port=True):
            pass
    except OSError as exc:  # gaierror included
        raise StartError(listen_problem(host, port, exc)) from exc


def _serve_argv(config: GatewayConfig, port: int) -> list[str]:
    return [sys.executable, "-m", "runtime", "serve", "--host", "127.0.0.1", "--port", str(port),
            *config.worker_argv()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False
