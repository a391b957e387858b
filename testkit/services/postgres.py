"""A real PostgreSQL server for tests: the distribution's server binaries (installed from its
package when missing, the service held back and disabled), a throwaway cluster made by initdb,
served on loopback on a free port, killed (SIGKILL of the whole server) and restarted on the
same port and data when a test needs the store to vanish and come back.

PostgreSQL refuses to run as root, so under root the cluster belongs to the `postgres` user and
every server command runs as that user (`subprocess`'s `user=`: a setuid before exec, so the
process we hold is the server itself, not a `su` wrapper that would outlive a kill). Its data
folder is made outside pytest's tmp_path, which is private to root.

`python -m testkit.services.postgres install` installs it (as root) for CI and the Makefile.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.gateway_server import free_port
from testkit.services import installer_main
from testkit.services.prometheus import apt_install_disabled

SERVER_USER = "postgres"  # who runs the server when we are root
SUPERUSER = "postgres"  # the cluster's role the tests connect as (trust on loopback)
NEEDED = ("initdb", "postgres", "pg_isready")


# ---- finding and installing -------------------------------------------------------------------
def find_bindir() -> str | None:
    """The folder of initdb, postgres and pg_isready: Debian's newest versioned folder first
    (its /usr/bin holds only wrappers), then whatever PATH has."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                        key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
                        reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(os.path.dirname(os.path.realpath(initdb)))
    for folder in candidates:
        if all(os.access(os.path.join(folder, name), os.X_OK) for name in NEEDED):
            return folder
    return None


def _server_user() -> str | None:
    """The user the server runs as: ourselves unless root; None when root and no such user."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    try:
        return pwd.getpwnam(SERVER_USER).pw_name
    except KeyError:
        return None


def ensure_bindir() -> str | None:
    """The binaries' folder; installed first when missing and we are root, else None."""
    found = find_bindir()
    if found and _server_user():
        return found
    return install() if os.geteuid() == 0 else None


def install() -> str:
    """`apt-get install postgresql` without starting or enabling Debian's cluster service, and
    the `postgres` user the server runs as under root."""
    found = find_bindir()
    if os.geteuid() != 0:
        if found:
            return found
        raise PermissionError("installing postgresql needs root (apt-get)")
    if not found:
        apt_install_disabled("postgresql", "postgresql")
        found = find_bindir()
        if not found:
            raise FileNotFoundError("apt-get installed postgresql but no initdb was found")
    if _server_user() is None:  # the package makes it; an image with bare binaries may not
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", SERVER_USER], check=True)
    return found


# ---- the server -------------------------------------------------------------------------------
class PostgresServer:
    """A throwaway cluster on 127.0.0.1:<free port>, database `postgres`, role `postgres`
    trusted on loopback. Durability settings are off (fsync): a killed server still keeps
    every committed row (the WAL is in the OS's cache), only a machine crash would lose them."""

    def __init__(self, bindir: str, user: str, ready_timeout: float = 60.0):
        self.bindir, self.user, self.ready_timeout = bindir, user, ready_timeout
        self.folder = Path(tempfile.mkdtemp(prefix="inferstack-pg-"))
        account = pwd.getpwnam(user)
        os.chown(self.folder, account.pw_uid, account.pw_gid)
        self.data = self.folder / "data"
        self.log_path = self.folder / "postgres.log"
        self.port = free_port()
        self.url = f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen | None = None
        done = self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                         "-E", "UTF8", "--no-sync", "--no-instructions")
        if done.returncode != 0:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RuntimeError(f"initdb failed: {done.stdout[-2000:]}")
        self.start()

    def _as_user(self) -> dict:
        return {"user": self.user, "group": pwd.getpwnam(self.user).pw_gid} \
            if os.geteuid() == 0 else {}

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(self.bindir, tool), *args], cwd=self.folder,
                              capture_output=True, text=True, check=False, timeout=120,
                              **self._as_user())

    def start(self) -> None:
        """Start (again) on the same port and data; after a kill that means crash recovery."""
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.proc = subprocess.Popen(
                [os.path.join(self.bindir, "postgres"), "-D", str(self.data),
                 "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                 "-c", "unix_socket_directories=", "-c", "fsync=off",
                 "-c", "max_connections=200"],
                cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, **self._as_user())
        finally:
            os.close(log)  # the child keeps its own descriptor
        deadline = time.monotonic() + self.ready_timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"postgres not ready in {self.ready_timeout} s")
            time.sleep(0.05)

    def ready(self) -> bool:
        """Accepting connections (not merely listening while it recovers)."""
        return self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port),
                         "-U", SUPERUSER, "-d", "postgres").returncode == 0

    def kill(self) -> None:
        """SIGKILL to the server and every backend at once (one process group): a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: sessions are cut, not waited
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def log_tail(self, size: int = 2000) -> str:
        return self.log_path.read_bytes()[-size:].decode(errors="replace")


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """For fixtures: a fresh cluster on loopback, stopped and deleted after. Skipped, naming
    the install command, when there are no binaries and no root to install them."""
    bindir, user = ensure_bindir(), _server_user()
    if bindir is None or user is None:
        pytest.skip("SKIPPED LOUDLY: no PostgreSQL server binaries (initdb, postgres) or no "
                    "`postgres` user, and not root to apt-get them: run "
                    "`python -m testkit.services.postgres install` as root (or `make services`)")
    server = PostgresServer(bindir, user)
    try:
        yield server
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    return installer_main("postgres", "the PostgreSQL server the tests start", install,
                          find_bindir, argv)


if __name__ == "__main__":
    sys.exit(main())
