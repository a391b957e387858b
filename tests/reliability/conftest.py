"""Gateways for the reliability suite, and the check that runs after every case.

Every test that uses a gateway fixture ends with `Gateway.assert_baseline()`: the server
answers /health and /ready, a normal request still succeeds, and nothing is left behind:
no running request, no KV block in use, an empty queue, no budget reserved, no request slot
counted on a worker, no open charge, every worker alive, the dispatch loop ticking, and every
ledger row whole (costs add up, a known status). Each gateway here runs the
deterministic fake engine on loopback; nothing here leaves the machine.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import aiohttp
import pytest

from billing.pricing import PriceBook
from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file

SOAK = bool(os.environ.get("RELIABILITY_SOAK"))
PRICES = PriceBook.preset("seed")

# tenant -> settings; (secret, tenant, admin, revoked[, may read /metrics])
TENANTS = {"alpha": {}, "beta": {}, "storm": {}, "vip": {"priority": -10}, "ops": {},
           "sharer": {"shared_cache": "true"}, "metered": {"requests_per_minute": 3}}
KEYS = [("sk-alpha", "alpha", False, False), ("sk-beta", "beta", False, False),
        ("sk-storm", "storm", False, False), ("sk-vip", "vip", False, False),
        ("sk-admin", "ops", True, False), ("sk-revoked", "alpha", False, True),
        ("sk-sharer", "sharer", False, False), ("sk-metered", "metered", False, False),
        ("sk-prometheus", "ops", False, False, True)]
STATUSES = {"ok", "cancelled", "error", "rejected"}

RSS_SLACK_BYTES = 20 << 20  # a case may leave the gateway this much larger (issue 33)


def write_keys(path):
    return write_key_file(path, TENANTS, KEYS)


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Gateway(GatewayProcess):
    """A gateway subprocess with keys and a ledger, and the checks the suite needs."""

    admin_key = "sk-admin"

    def __init__(self, tmp_path, *flags: str, workers: int = 1):
        self.ledger_path = str(tmp_path / "ledger.sqlite3")
        self.keys_path = write_keys(tmp_path / "keys.toml")
        self.workers = workers
        super().__init__("--fake", "--keys-file", self.keys_path, "--ledger-path",
                         self.ledger_path, "--prices", "seed", "--workers", str(workers),
                         *flags)
        deadline = time.monotonic() + 120
        while self.ready_info()["workers_ready"] < workers:  # /ready is 200 with the first
            assert time.monotonic() < deadline, "workers did not all start"
            time.sleep(0.1)

    # ---- observables --------------------------------------------------------------------
    def ready_info(self) -> dict:
        return json.loads(self.get("/ready", self.admin_key)[1])

    def gauges(self) -> dict:
        names = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "inferstack:gateway_queue_length", "inferstack:budget_reserved_usd",
                 "inferstack:workers_alive", "inferstack:dispatcher_alive",
                 "inferstack:worker_slots_in_use", "inferstack:open_charges")
        return self.metrics(names)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            parts = fh.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def ledger_rows(self, where: str = "1=1", args=()) -> list[dict]:
        db = sqlite3.connect(f"file:{self.ledger_path}?mode=ro", uri=True, timeout=30)
        try:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute(f"SELECT * FROM requests WHERE {where}", args)]
        finally:
            db.close()

    # ---- the check after every case -----------------------------------------------------
    def settled(self) -> tuple[bool, dict]:
        g = self.gauges()
        ok = (g["vllm:num_requests_running"] == 0 and g["vllm:kv_cache_usage_perc"] == 0
              and g["inferstack:gateway_queue_length"] == 0
              and abs(g["inferstack:budget_reserved_usd"]) < 1e-12
              and g["inferstack:workers_alive"] == self.workers
              and g["inferstack:dispatcher_alive"] == 1
              and g["inferstack:worker_slots_in_use"] == 0
              and g["inferstack:open_charges"] == 0)
        return ok, g

    def marks(self) -> tuple[float, int]:
        """(loop stalls so far, RSS now): what a case must not raise (`assert_baseline`)."""
        return self.metrics(("inferstack:event_loop_stalls_total",))[
            "inferstack:event_loop_stalls_total"], self.rss_bytes()

    def assert_baseline(self, timeout: float = 20.0,
                        since: tuple[float, int] | None = None) -> None:
        """Healthy and nothing leaked; with `since` (`marks()` before the case) also: the
        event loop never held over 100 ms during it, and the RSS back within 20 MB."""
        assert self.proc.poll() is None, "the gateway process died"
        deadline = time.monotonic() + timeout
        while True:
            ok, g = self.settled()
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ok, f"not back to baseline: {g}"
        assert self.get("/health")[0] == 200
        assert self.get("/ready")[0] == 200
        status, body = self.post_json("/v1/completions", {"prompt": "ping", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        assert_ledger_whole(self.ledger_rows())
        if since is not None:
            self._assert_no_stall_nor_growth(*since)

    def _assert_no_stall_nor_growth(self, stalls_before: float, rss_before: int) -> None:
        stalls, rss = self.marks()
        assert stalls == stalls_before, \
            f"the event loop was held over 100 ms {stalls - stalls_before:g} times"
        deadline = time.monotonic() + 5  # freed memory returns to the system a little later
        while rss > rss_before + RSS_SLACK_BYTES and time.monotonic() < deadline:
            time.sleep(0.2)
            rss = self.rss_bytes()
        assert rss <= rss_before + RSS_SLACK_BYTES, \
            f"the gateway grew by {(rss - rss_before) / 2**20:.1f} MiB over the case"

    def post_json(self, path: str, body: dict, key: str = "sk-alpha") -> tuple[int, dict]:
        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.post(self.url + path, json=body, headers=auth(key),
                                  timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return r.status, await r.json(content_type=None)
        return asyncio.run(go())

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def assert_ledger_whole(rows: list[dict]) -> None:
    """No partial rows: every column a finished request must have, and costs that add up."""
    for r in rows:
        assert r["status"] in STATUSES, r
        assert r["tenant"] and r["created"] and r["finished"] >= r["created"] - 1, r
        for k in ("cache_hit_tokens", "cache_miss_tokens", "output_tokens"):
            assert r[k] is not None and r[k] >= 0, r
        parts = r["cost_cache_hit"] + r["cost_cache_miss"] + r["cost_output"]
        assert abs(parts - r["cost_total"]) < 1e-12, r
        expect = PRICES.cost(r["cache_hit_tokens"], r["cache_miss_tokens"], r["output_tokens"],
                             r["price_multiplier"])
        assert abs(expect.total - r["cost_total"]) < 1e-12, r
        if r["status"] in ("rejected", "error"):  # our refusal or our fault: not billed
            assert r["cost_total"] == 0, r


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """The shared gateway: 8 request slots, a 1 MiB body limit, 2 s body and head timeouts."""
    server = Gateway(tmp_path_factory.mktemp("gw"), "--fake-step-ms", "5",
                     "--max-num-seqs", "8", "--max-queue", "1024", "--max-body-bytes",
                     str(1 << 20), "--body-timeout-seconds", "2",
                     "--header-timeout-seconds", "2")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _back_to_baseline(request):
    """After every case on the shared gateway: healthy, nothing leaked, the loop never held,
    the memory back."""
    gw = request.getfixturevalue("gw") if "gw" in request.fixturenames else None
    before = gw.marks() if gw is not None else None
    yield
    if gw is not None and getattr(request.node, "rep_call_passed", False):
        gw.assert_baseline(since=before)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call_passed = report.passed
    return report


def pytest_collection_modifyitems(config, items):
    if SOAK:
        return
    skip = pytest.mark.skip(reason="soak: run with RELIABILITY_SOAK=1 (make soak)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)

