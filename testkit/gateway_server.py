"""Start a real gateway process on a free loopback port and wait until it is ready.

Shared by the tests that drive a gateway over HTTP and by the benchmarks that do
(`bench/disagg.py`, `bench/loadtest.py`), so neither imports the other.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    admin_key: str | None = None  # sent on /metrics and /ready when the gateway has keys

    def __init__(self, *flags: str, ready_timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # the log file lives as long as the process it captures
        self.log = open(os.devnull, "wb") if not os.environ.get("GATEWAY_TEST_LOG") else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(self.port), *flags],
            env=env, stdout=self.log, stderr=self.log, start_new_session=True)
        self.wait_ready(ready_timeout)

    def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path,
                                                               headers=headers),
                                        timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}")
            try:
                if self.get("/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("gateway did not become ready")

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in /metrics (0 when absent)."""
        return self.metrics([name])[name]

    def metrics(self, names) -> dict[str, float]:
        """Sums of several metrics' samples from one read of /metrics (0 when absent)."""
        out = dict.fromkeys(names, 0.0)
        for line in self.get("/metrics", self.admin_key)[1].decode().splitlines():
            for name in names:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
