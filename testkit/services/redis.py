"""A real Redis server for tests: found on the machine or installed from the distribution's
package (its service held back and disabled), started on loopback on a free port with a
throwaway folder and no persistence, killed and restarted on the same port when a test needs
the store to vanish and come back.

`python -m testkit.services.redis install` installs it (as root) for CI and the Makefile.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.gateway_server import free_port
from testkit.services import installer_main
from testkit.services.prometheus import apt_install_disabled

DEBIAN_BINARY = "/usr/bin/redis-server"


# ---- finding and installing -------------------------------------------------------------------
def find_binary() -> str | None:
    found = shutil.which("redis-server")
    return found or (DEBIAN_BINARY if os.access(DEBIAN_BINARY, os.X_OK) else None)


def ensure_binary() -> str | None:
    """The binary's path; installed first when missing and we are root, else None."""
    found = find_binary()
    if found or os.geteuid() != 0:
        return found
    return install()


def install() -> str:
    """`apt-get install redis-server` without starting or enabling Debian's service: the tests
    want a binary, not a daemon on port 6379 at every boot."""
    found = find_binary()
    if found:
        return found
    if os.geteuid() != 0:
        raise PermissionError("installing redis-server needs root (apt-get)")
    apt_install_disabled("redis-server", "redis-server")
    found = find_binary()
    if not found:
        raise FileNotFoundError("apt-get installed redis-server but no binary was found")
    return found


# ---- the server -------------------------------------------------------------------------------
class RedisServer:
    """redis-server on 127.0.0.1:<free port>; nothing is saved, so a restart starts empty (as
    a Redis that lost its data would: the gateways must cope with that too)."""

    def __init__(self, binary: str, folder: Path, ready_timeout: float = 30.0):
        self.binary, self.folder, self.ready_timeout = binary, folder, ready_timeout
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = folder / "redis.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (again) on the same port."""
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [self.binary, "--bind", "127.0.0.1", "--port", str(self.port),
                 "--dir", str(self.folder), "--save", "", "--appendonly", "no",
                 "--daemonize", "no", "--protected-mode", "yes"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server not ready in {self.ready_timeout} s")
            time.sleep(0.05)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, size: int = 2000) -> str:
        return self.log_path.read_bytes()[-size:].decode(errors="replace")


@contextmanager
def redis_server(folder: Path) -> Iterator[RedisServer]:
    """For fixtures: a Redis on loopback, stopped after. Skipped, naming the install command,
    when there is no binary and no root to install it."""
    binary = ensure_binary()
    if binary is None:
        pytest.skip("SKIPPED LOUDLY: no redis-server binary and not root to apt-get it: run "
                    "`python -m testkit.services.redis install` as root (or `make services`)")
    server = RedisServer(binary, folder)
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    return installer_main("redis", "the Redis server the tests start", install, find_binary, argv)


if __name__ == "__main__":
    sys.exit(main())
