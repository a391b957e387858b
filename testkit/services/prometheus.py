"""A real Prometheus server for tests: found on the machine or installed from the distribution's
package, started on loopback with a throwaway data folder and a generated config that scrapes
one target every second, and a small client for its HTTP API.

`python -m testkit.services.prometheus install` installs it (as root) for CI and the Makefile.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.gateway_server import GatewayProcess, free_port
from testkit.services import installer_main

DEBIAN_BINARY = "/usr/bin/prometheus"
POLICY_RC = Path("/usr/sbin/policy-rc.d")
REFUSE_ALL = "#!/bin/sh\n# written by testkit/services/prometheus.py for one install\nexit 101\n"
JOB = "gateway"
SCRAPE_INTERVAL = "1s"


# ---- finding and installing -------------------------------------------------------------------
def find_binary() -> str | None:
    found = shutil.which("prometheus")
    return found or (DEBIAN_BINARY if os.access(DEBIAN_BINARY, os.X_OK) else None)


def ensure_binary() -> str | None:
    """The binary's path; installed first when missing and we are root, else None."""
    found = find_binary()
    if found or os.geteuid() != 0:
        return found
    return install()


def install() -> str:
    """`apt-get install prometheus` without starting or enabling Debian's service: the tests
    want a binary, not a daemon listening on every address at boot."""
    found = find_binary()
    if found:
        return found
    if os.geteuid() != 0:
        raise PermissionError("installing prometheus needs root (apt-get)")
    # recommends would bring prometheus-node-exporter, a second service
    apt_install_disabled("prometheus", "prometheus")
    found = find_binary()
    if not found:
        raise FileNotFoundError("apt-get installed prometheus but no binary was found")
    return found


@contextmanager
def services_held_back() -> Iterator[None]:
    """Debian's maintainer scripts start a package's service unless policy-rc.d exits 101.
    A policy already refusing (Docker images ship one) is left alone; otherwise ours stands in
    for the install only, and any other policy is set aside and put back afterwards."""
    if _policy_refuses():
        yield
        return
    saved = POLICY_RC.with_name(POLICY_RC.name + ".inferstack-saved")
    had_policy = POLICY_RC.exists()
    if had_policy:
        os.replace(POLICY_RC, saved)
    try:
        POLICY_RC.write_text(REFUSE_ALL)
        POLICY_RC.chmod(0o755)
        yield
    finally:
        POLICY_RC.unlink(missing_ok=True)
        if had_policy:
            os.replace(saved, POLICY_RC)


def _policy_refuses() -> bool:
    if not os.access(POLICY_RC, os.X_OK):
        return False
    result = subprocess.run([str(POLICY_RC), "prometheus.service", "start"],
                            capture_output=True, check=False)
    return result.returncode == 101


def apt_install_disabled(package: str, service: str) -> None:
    """`apt-get install` a Debian package (without recommends) whose service is neither
    started nor enabled: the tests want its binaries, not a daemon at every boot. Not started
    is not enough: on a machine that boots with systemd or sysvinit, the package also enabled
    the service; tools that are absent are simply skipped."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
    with services_held_back():
        subprocess.run([*apt, "update"], env=env, check=True)
        subprocess.run([*apt, "install", "-y", "--no-install-recommends", package],
                       env=env, check=True)
    for argv in (["deb-systemd-helper", "disable", f"{service}.service"],
                 ["update-rc.d", service, "disable"]):
        if shutil.which(argv[0]):
            subprocess.run(argv, capture_output=True, check=False)


# ---- the server -------------------------------------------------------------------------------
def scrape_config(target_url: str, key: str | None) -> dict:
    """One job scraping `target_url`/metrics every second; the key goes as a bearer token
    (`authorization: {credentials: KEY}`), the way an operator would give a metrics key."""
    target = urllib.parse.urlsplit(target_url)
    job: dict = {"job_name": JOB, "scrape_interval": SCRAPE_INTERVAL,
                 "scrape_timeout": SCRAPE_INTERVAL,  # must not exceed the interval
                 "metrics_path": "/metrics", "scheme": target.scheme,
                 "static_configs": [{"targets": [target.netloc]}]}
    if key:
        job["authorization"] = {"type": "Bearer", "credentials": key}
    return {"global": {"scrape_interval": SCRAPE_INTERVAL,
                       "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [job]}


class PrometheusServer:
    """A prometheus process on 127.0.0.1:<free port>, its data and log in `folder`."""

    def __init__(self, binary: str, folder: Path, target_url: str, key: str | None,
                 ready_timeout: float = 60.0):
        taken = urllib.parse.urlsplit(target_url).port
        self.port = free_port()
        while self.port == taken:  # a target still starting has not bound its port yet
            self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = folder
        config = folder / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(target_url, key), indent=1))  # JSON is YAML
        self.log_path = folder / "prometheus.log"
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.api = PrometheusClient(self.url)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if self.api.ready():
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus was not ready in {timeout} s: {self.log_tail()}")

    def log_tail(self, size: int = 2000) -> str:
        return self.log_path.read_bytes()[-size:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _ScrapedGateway(GatewayProcess):
    """A gateway whose Prometheus starts the moment its port is known: Prometheus applies new
    targets on a 5 s tick, and that wait then overlaps the gateway's own start."""

    def __init__(self, binary: str, folder: Path, key: str, *flags: str):
        self.scraper_args = (binary, folder, key)
        self.scraper: PrometheusServer | None = None
        self.admin_key = key  # the tests read /metrics with the key Prometheus uses
        super().__init__(*flags)

    def wait_ready(self, timeout: float) -> None:
        if self.scraper is None:
            binary, folder, key = self.scraper_args
            self.scraper = PrometheusServer(binary, folder, self.url, key)
        try:
            super().wait_ready(timeout)
        except BaseException:  # nobody else holds either process yet
            self.close()
            raise

    def close(self) -> None:
        self.stop()
        if self.scraper is not None:
            self.scraper.stop()


@contextmanager
def scraped_gateway(folder: Path, key: str, *flags: str
                    ) -> Iterator[tuple[GatewayProcess, PrometheusServer]]:
    """For fixtures: a gateway (`flags` as for `python -m gateway`) that reads /metrics with
    `key`, and a Prometheus that has scraped it once with the same key; both stopped after.
    The test is skipped, naming the install command, when there is no binary and no root."""
    binary = ensure_binary()
    if binary is None:
        pytest.skip("no prometheus binary and not root to apt-get it: run "
                    "`python -m testkit.services.prometheus install` as root")
    gateway = _ScrapedGateway(binary, folder, key, *flags)
    assert gateway.scraper is not None
    try:
        # Prometheus applies new targets on a 5 s tick: the first scrape comes that late
        gateway.scraper.api.wait_for_scrape(after=0)
        yield gateway, gateway.scraper
    finally:
        gateway.close()


# ---- the HTTP API -----------------------------------------------------------------------------
class PrometheusClient:
    """The few calls of Prometheus's HTTP API (/api/v1) the tests need."""

    def __init__(self, url: str):
        self.url = url

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:  # refused while starting, or 503 until the TSDB is open
            return False

    def call(self, path: str, **params: str) -> dict:
        """The API's JSON answer; a bad query comes back as status "error", not an exception."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400 and 422 carry the error as JSON
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        return self.call("/api/v1/query", query=expr)

    def vector(self, expr: str) -> list[tuple[dict, float]]:
        """An instant query's samples as (labels, value); raises on a query error."""
        answer = self.query(expr)
        if answer["status"] != "success":
            raise ValueError(f"{expr}: {answer.get('errorType')}: {answer.get('error')}")
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def value(self, expr: str) -> float:
        """The single sample of an instant query."""
        samples = self.vector(expr)
        if len(samples) != 1:
            raise ValueError(f"{expr}: expected one sample, got {samples}")
        return samples[0][1]

    def last_scrape(self, job: str = JOB) -> float | None:
        """Unix time of the job's latest successful scrape (its `up` sample), or None.
        timestamp() gives a sample's own time only when applied to a selector directly (of
        a computed vector it gives the evaluation time), so the health filter comes after."""
        up = f'up{{job="{job}"}}'
        samples = self.vector(f"timestamp({up}) and on(job, instance) ({up} == 1)")
        return samples[0][1] if samples else None

    def wait_for_scrape(self, after: float, job: str = JOB, timeout: float = 20.0) -> float:
        """Wait for a successful scrape that started after `after` (Unix time): what it read
        was the state at or after that moment."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.last_scrape(job)
            if seen is not None and seen > after:
                return seen
            time.sleep(0.1)
        raise TimeoutError(f"no scrape of {job} after {after}: {self.target_errors()}")

    def target_errors(self) -> list[str]:
        targets = self.call("/api/v1/targets")["data"]["activeTargets"]
        return [f"{t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in targets]


def main(argv: list[str] | None = None) -> int:
    return installer_main("prometheus", "the Prometheus the tests start", install,
                          find_binary, argv)


if __name__ == "__main__":
    sys.exit(main())
