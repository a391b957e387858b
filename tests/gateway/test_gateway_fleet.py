"""A fleet of gateways: `--worker-url`/`--gateways` settings, `python -m gateway --gateways 2`
serving one port from two processes over one shared worker with real PostgreSQL and Redis,
two separate gateways over one `python -m runtime serve` with one of them SIGKILLed
mid-stream, and a fleet without shared stores refused.

The ledger rule after a gateway is killed: a request is billed only when a live gateway
settles it. The killed gateway's running requests are aborted by the worker and get no
ledger row (their clients never received a final usage); their budget reservations are held,
never spent, until they expire. Every row bills exactly the output its client received, and
the tenant's spent money equals the sum of its rows.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import aiohttp
import asyncpg
import orjson
import pytest

from contract.frames import TOKEN_ENV
from gateway.config import load_config
from gateway.supervisor import Fleet, child_environ
from runtime.transport.serve import MIN_TOKEN_CHARS
from testkit.gateway_server import GatewayProcess
from testkit.services.postgres import postgres_server
from testkit.services.redis import redis_server
from tests.gateway.keyfile import write_key_file
from tests.runtime.test_serve import FAKE, LONG, FrameClient, ServeProcess

TENANTS = {"fleet": {"budget_usd": 1.0}, "ops": {}}
KEYS = [("sk-fleet", "fleet", False, False), ("sk-ops", "ops", True, False)]
HEADERS = {"Authorization": "Bearer sk-fleet"}


# ---- settings ----------------------------------------------------------------------------
def test_worker_urls_from_flags_environment_and_toml(tmp_path):
    a, b = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"
    flags = load_config(["--workers", "0", "--worker-url", a, "--worker-url", b], environ={})
    assert (flags.workers, flags.worker_urls) == (0, (a, b))
    env = load_config([], environ={"INFERSTACK_WORKER_URLS": f"{a}, {b}"})
    assert env.worker_urls == (a, b)
    toml = tmp_path / "gw.toml"
    toml.write_text(f'worker_urls = ["{a}", "{b}"]\nworkers = 0\n')
    assert load_config(["--config", str(toml)], environ={}).worker_urls == (a, b)
    # a flag wins over the environment, which wins over the file, as for every setting
    assert load_config(["--config", str(toml), "--worker-url", b],
                       environ={"INFERSTACK_WORKER_URLS": a}).worker_urls == (b,)


def test_counts_that_cannot_serve_are_refused():
    with pytest.raises(SystemExit, match="--workers 0 needs at least one --worker-url"):
        load_config(["--workers", "0"], environ={})
    with pytest.raises(SystemExit, match="--pd and --worker-url"):
        load_config(["--pd", "1:1", "--worker-url", "tcp://h:1"], environ={})
    for stores in ([], ["--state-url", "postgresql://h/db"], ["--redis-url", "redis://h"]):
        with pytest.raises(SystemExit, match="needs both --state-url .* and --redis-url .* "
                                             "per gateway"):
            load_config(["--gateways", "2", *stores], environ={})


def test_a_child_resolves_the_supervisors_config_from_its_environment(monkeypatch):
    monkeypatch.setenv("INFERSTACK_PRICES", "deepseek-r1")  # the parent's, through its config
    monkeypatch.setenv("INFERSTACK_OTLP_ENDPOINT", "http://o:4318")
    parent = load_config(["--gateways", "3", "--state-url", "postgresql://u:secret@h/db",
                          "--redis-url", "redis://h", "--fake", "--no-telemetry", "--port",
                          "8123", "--max-num-seqs", "77", "--fake-step-ms", "0.5"])
    changes = {"gateways": 1, "workers": 0, "worker_urls": ("tcp://127.0.0.1:9",),
               "reuse_port": True, "otlp_endpoint": None}
    env = child_environ(parent, **changes)
    assert load_config([], environ=env) == dataclasses.replace(parent, **changes)
    assert parent.prices == "deepseek-r1" and "INFERSTACK_OTLP_ENDPOINT" not in env


def test_the_fleets_own_workers_demand_a_secret_its_gateways_hold(monkeypatch, tmp_path):
    """Workers on loopback are reachable by every process on the host: the supervisor starts
    its own with a fresh secret each start and gives it to its gateways alone."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = load_config(["--gateways", "2", "--workers", "2", "--fake", "--state-url",
                          "postgresql://h/db", "--redis-url", "redis://h", "--ledger-path",
                          str(tmp_path / "ledger.sqlite3")], environ={})
    fleet = Fleet(config)
    tokens = {child.env[TOKEN_ENV] for child in fleet.workers + fleet.gateways}
    assert len(tokens) == 1 and len(next(iter(tokens))) >= MIN_TOKEN_CHARS
    assert Fleet(config).workers[0].env[TOKEN_ENV] not in tokens  # a new one each start
    monkeypatch.setenv(TOKEN_ENV, "the-operators-own-secret-0123456789")
    assert Fleet(config).gateways[1].env[TOKEN_ENV] == "the-operators-own-secret-0123456789"


def test_a_fleet_without_shared_stores_refuses_to_start():
    done = subprocess.run([sys.executable, "-m", "gateway", "--gateways", "2", "--fake"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--gateways N needs both --state-url (PostgreSQL) and --redis-url (Redis)" \
        in done.stderr
    assert "enforced per gateway" in done.stderr


# ---- real fleets -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    keys = write_key_file(tmp / "keys.toml", TENANTS, KEYS)
    with postgres_server() as pg, redis_server(tmp) as rd:
        yield SimpleNamespace(pg=pg, rd=rd, tmp=tmp, keys=keys)


def shared_flags(stores, name: str) -> list[str]:
    return ["--keys-file", stores.keys, "--state-url", stores.pg.url, "--redis-url",
            stores.rd.url, "--ledger-path", str(stores.tmp / f"{name}.sqlite3")]


def pg_query(stores, sql: str, *args) -> list:
    async def run():
        conn = await asyncpg.connect(stores.pg.url)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()
    return asyncio.run(run())


def ledger(stores) -> dict[str, int]:
    """Request id -> billed output tokens, for the test tenant."""
    return {r[0]: r[1] for r in pg_query(
        stores, "SELECT id, output_tokens FROM requests WHERE tenant = 'fleet'")}


def answering(url: str, want: int, timeout: float = 120.0) -> set[str]:
    """The x-gateway-instance of ready answers on fresh connections, until `want` differ."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only {seen} answered"
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                seen.add(r.headers["x-gateway-instance"])
        except OSError:
            time.sleep(0.1)
    return seen


def children(pid: int) -> dict[int, str]:
    """The supervisor's child processes: pid -> command line."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    found[int(child)] = c.read().replace(b"\0", b" ").decode()
    return found


async def stream(session, url: str, max_tokens: int, read: int | None = None) -> dict:
    """A streamed completion: its id, gateway instance, text chunks, final usage and [DONE];
    with `read`, the open response after that many chunks instead (`finish` reads on)."""
    resp = await session.post(url + "/v1/completions", headers=HEADERS, json={
        "prompt": "fleet", "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200, await resp.text()
    got = {"id": resp.headers["x-request-id"],
           "instance": resp.headers.get("x-gateway-instance"),
           "chunks": 0, "usage": None, "done": False, "resp": resp}
    return await finish(got, read)


async def finish(got: dict, read: int | None = None) -> dict:
    async for line in got["resp"].content:
        if line.startswith(b"data: [DONE]"):
            got["done"] = True
            break
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            if event.get("usage"):
                got["usage"] = event["usage"]["completion_tokens"]
            got["chunks"] += sum(1 for c in event.get("choices", []) if c.get("text"))
            if read is not None and got["chunks"] >= read:
                return got
    got["resp"].release()
    return got


def status_with(url: str, key: str) -> tuple[int, str]:
    """(status, answering instance) of a small completion on a fresh connection."""
    request = urllib.request.Request(
        url + "/v1/completions", data=orjson.dumps({"prompt": "k", "max_tokens": 1}),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["x-gateway-instance"]
    except urllib.error.HTTPError as e:
        return e.code, e.headers["x-gateway-instance"]


@pytest.mark.postgres
@pytest.mark.redis
def test_two_gateway_processes_share_one_port_and_one_ledger(stores):
    keys = stores.tmp / "fleet-keys.toml"
    write_key_file(keys, TENANTS, KEYS)
    flags = shared_flags(stores, "fleet")
    flags[flags.index("--keys-file") + 1] = str(keys)
    fleet = GatewayProcess("--gateways", "2", "--workers", "1", *FAKE, *flags)
    try:
        instances = answering(fleet.url, 2)

        async def main():
            # a connection each: the kernel spreads connections, not requests
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector) as s:
                return await asyncio.gather(*(stream(s, fleet.url, 40) for _ in range(40)))
        answers = asyncio.run(main())
        assert all(a["done"] and a["usage"] == 40 for a in answers)
        assert {a["instance"] for a in answers} == instances  # both processes served some
        billed = ledger(stores)
        assert billed == {a["id"]: 40 for a in answers}  # one row per request, what was sent

        # SIGHUP to the supervisor: every gateway rereads the key file
        assert status_with(fleet.url, "sk-late")[0] == 401
        write_key_file(keys, TENANTS, [*KEYS, ("sk-late", "fleet", False, False)])
        os.kill(fleet.proc.pid, signal.SIGHUP)
        served: set[str] = set()
        deadline = time.monotonic() + 60
        while served != instances:
            assert time.monotonic() < deadline, f"the new key works on {served} only"
            status, instance = status_with(fleet.url, "sk-late")
            if status == 200:
                served.add(instance)

        # a gateway that dies is replaced, and the port keeps serving meanwhile
        procs = children(fleet.proc.pid)
        gateways = [p for p, cmd in procs.items() if " -m gateway" in cmd]
        assert len(gateways) == 2 and len(procs) == 3  # and one runtime.transport.serve worker
        os.kill(gateways[0], signal.SIGKILL)
        again = answering(fleet.url, 2)
        assert len(again - instances) == 1  # one replaced, one the same
        procs |= children(fleet.proc.pid)

        # SIGTERM to the supervisor drains: a stream in flight still finishes
        async def drained():
            async with aiohttp.ClientSession() as s:
                running = await stream(s, fleet.url, 300, read=1)
                os.kill(fleet.proc.pid, signal.SIGTERM)
                return await finish(running)
        last = asyncio.run(drained())
        assert last["done"] and last["usage"] == 300
        assert fleet.proc.wait(60) == 0  # drained: every gateway exited 0
        for pid in procs:  # and none outlived the supervisor, workers included
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        fleet.stop()


@pytest.mark.postgres
@pytest.mark.redis
def test_a_killed_gateways_requests_are_freed_and_never_billed(stores):
    worker = ServeProcess(*FAKE)
    gws = [GatewayProcess("--fake", "--workers", "0", "--worker-url", worker.url,
                          *shared_flags(stores, f"gw{i}")) for i in range(2)]
    doomed, survivor = gws
    observer = FrameClient(worker.port)
    before = set(ledger(stores))
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                finished = await stream(s, doomed.url, 5)  # settled before the kill
                cut = [await stream(s, doomed.url, LONG, read=3) for _ in range(3)]
                kept = [asyncio.create_task(stream(s, survivor.url, 400)) for _ in range(2)]
                await asyncio.to_thread(observer.stats_where, lambda st: st["running"] == 5)
                os.killpg(doomed.proc.pid, signal.SIGKILL)
                doomed.proc.wait()
                after = await asyncio.to_thread(observer.stats_where,
                                                lambda st: st["running"] <= 2)
                for c in cut:
                    c["resp"].close()
                return finished, cut, await asyncio.gather(*kept), after
        finished, cut, kept, after = asyncio.run(main())
        assert after["waiting"] == 0
        assert all(k["done"] and k["usage"] == 400 for k in kept)  # the survivor streamed on
        idle = observer.stats_where(lambda st: True, idle=True)
        assert (idle["running"], idle["waiting"], idle["kv_blocks_used"]) == (0, 0, 0)
        rows = {i: n for i, n in ledger(stores).items() if i not in before}
        expected = {finished["id"]: 5, **{k["id"]: 400 for k in kept}}
        assert rows == expected  # the cut requests: no row; the rest: what their clients got
        assert not {c["id"] for c in cut} & set(rows)
        (spent, costs), = pg_query(stores, "SELECT (SELECT SUM(spent) FROM budget_periods "
                                           "WHERE tenant = 'fleet'), (SELECT SUM(cost_total) "
                                           "FROM requests WHERE tenant = 'fleet')")
        assert float(spent) == pytest.approx(costs)  # the money equals the rows
    finally:
        observer.close()
        for gw in gws:
            gw.stop()
        worker.stop()
