"""The gateway's log carries each worker's log lines once (it forwards the workers' stderr),
and a gateway stopped with SIGTERM leaves no third-party noise: no "nanobind: leaked" lines
(a CPU worker never imports triton) and no traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

from testkit.gateway_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_then_stop(tmp_path, *flags: str, timeout: float = 240.0) -> tuple[int, list[str]]:
    """Start a gateway, wait until it serves, SIGTERM it; (exit status, its stderr lines)."""
    port = free_port()
    log_path = tmp_path / "gateway.log"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("INFERSTACK_KERNELS", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(port),
                                 "--ledger-path", str(tmp_path / "ledger.sqlite3"), *flags],
                                cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while not _ready(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    return code, log_path.read_text().splitlines()


def _worker_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if " runtime." in line]


def test_each_worker_line_reaches_the_log_once(tmp_path):
    code, lines = serve_then_stop(tmp_path, "--fake", "--workers", "2")
    assert code == 0, "\n".join(lines)
    ready = [line for line in lines if "runtime.transport.worker: worker pid" in line]
    assert len(ready) == 2, "\n".join(lines)
    pids = {line.split("worker pid ")[1].split()[0] for line in ready}
    assert len(pids) == 2, "\n".join(lines)  # one line from each worker, not one twice


def test_sigterm_with_the_real_model_leaves_no_noise(tmp_path):
    code, lines = serve_then_stop(tmp_path)  # the default model on the CPU
    text = "\n".join(lines)
    assert code == 0, text
    assert not any("nanobind" in line for line in lines), text
    assert "Traceback" not in text, text
    assert lines[-1].endswith("stopped (drained)"), text
    worker = _worker_lines(lines)
    assert any("worker pid" in line and " ready in " in line for line in worker), text
    doubled = [line for line, n in Counter(worker).items() if n > 1]
    assert not doubled, text
