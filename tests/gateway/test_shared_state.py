"""A fleet of two gateway processes (fake engine) sharing one PostgreSQL (ledger, budgets) and
one Redis (rate limits, fair share), all real servers on loopback: one budget is never
overspent by both together and each admitted request has exactly one ledger row; one request
rate holds across both; with either store killed, new requests are refused with 503 and
Retry-After, what was running is still billed, and service resumes by itself."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from types import SimpleNamespace

import aiohttp
import asyncpg
import orjson
import pytest

from billing.pricing import PriceBook
from testkit.gateway_server import GatewayProcess
from testkit.services.postgres import postgres_server
from testkit.services.redis import redis_server
from tests.gateway.keyfile import write_key_file

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

PROMPT = [1, 2, 3]  # token ids: exactly three prompt tokens, none of them cached
PRICES = PriceBook.preset("seed")
WORST = PRICES.cost(0, len(PROMPT), 10, PRICES.multiplier()).total  # 10 output tokens
BUDGET = 50.5 * WORST  # covers 50 such requests, not 51
RPM = 6
TENANTS = {"spender": {"budget_usd": BUDGET}, "paced": {"requests_per_minute": RPM},
           "steady": {"requests_per_minute": 1000, "tokens_per_minute": 10**6,
                      "budget_usd": 1.0},
           "open": {}, "durable": {"budget_usd": 1.0}, "ops": {}}
KEYS = [(f"sk-{name}", name, name == "ops", False) for name in TENANTS]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    keys = write_key_file(tmp / "keys.toml", TENANTS, KEYS)
    with postgres_server() as pg, redis_server(tmp) as rd:
        gateways = []
        try:
            for i in range(2):
                gw = GatewayProcess("--fake", "--fake-step-ms", "10", "--keys-file", keys,
                                    "--prices", "seed", "--ledger-path",
                                    str(tmp / f"ledger-{i}.sqlite3"), "--state-url", pg.url,
                                    "--redis-url", rd.url)
                gw.admin_key = "sk-ops"
                gateways.append(gw)
            yield SimpleNamespace(pg=pg, rd=rd, gws=gateways)
        finally:
            for gw in gateways:
                gw.stop()


@dataclass
class Answer:
    status: int
    headers: dict
    body: dict
    gateway: int


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def post(session, fleet, i: int, key: str, body: dict) -> Answer:
    async with session.post(fleet.gws[i % 2].url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return Answer(r.status, dict(r.headers), await r.json(), i % 2)


async def open_stream(session, fleet, i: int, key: str, max_tokens: int):
    """A streamed request read up to its first chunk: admitted and running. (response, id)"""
    r = await session.post(fleet.gws[i % 2].url + "/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": max_tokens, "stream": True},
                           headers={"Authorization": f"Bearer {key}"})
    assert r.status == 200, await r.text()
    async for line in r.content:
        if line.startswith(b"data: {"):
            return r, orjson.loads(line[6:])["id"]
    raise AssertionError("the stream ended before its first chunk")


async def finish_stream(r) -> tuple[bool, list]:
    """Read to the end: (saw [DONE], error events)."""
    done, errors = False, []
    async for line in r.content:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: {") and b'"error"' in line:
            errors.append(orjson.loads(line[6:]))
    r.release()
    return done, errors


async def until_served(session, fleet, key: str, timeout: float = 30.0) -> list[Answer]:
    """Send to each gateway until both answer 200 (the store came back); every answer."""
    answers: list[Answer] = []
    deadline = time.monotonic() + timeout
    for i in range(2):
        while True:
            answers.append(await post(session, fleet, i, key,
                                      {"prompt": PROMPT, "max_tokens": 2}))
            if answers[-1].status == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return answers


def pg_query(fleet, sql: str, *args):
    async def run():
        conn = await asyncpg.connect(fleet.pg.url)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()
    return asyncio.run(run())


def ledger_ids(fleet, tenant: str) -> list[str]:
    return sorted(r[0] for r in pg_query(fleet, "SELECT id FROM requests WHERE tenant = $1",
                                         tenant))


def held(fleet, tenant: str) -> tuple[Decimal, int]:
    """(reserved, reservations) of a tenant in PostgreSQL."""
    (reserved,) = pg_query(fleet, "SELECT COALESCE(SUM(reserved), 0) FROM budget_periods "
                                  "WHERE tenant = $1", tenant)[0]
    (count,) = pg_query(fleet, "SELECT COUNT(*) FROM reservations WHERE tenant = $1",
                        tenant)[0]
    return reserved, count


def reserved_gauges(fleet) -> float:
    return sum(gw.metric("inferstack:budget_reserved_usd") for gw in fleet.gws)


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result


def assert_refused_closed(answers: list[Answer]) -> None:
    for a in answers:
        assert a.status == 503, a.body
        assert a.body["error"]["code"] == "store_unavailable"
        assert a.body["error"]["type"] == "server_error"
        assert int(a.headers["Retry-After"]) >= 1


# ---- budgets and rates across the fleet ----------------------------------------------------
def test_two_gateways_never_overspend_one_budget(fleet):
    async def main():
        async with client() as s:
            body = {"prompt": PROMPT, "max_tokens": 10}
            return await asyncio.gather(*(post(s, fleet, i, "sk-spender", body)
                                          for i in range(200)))
    answers = asyncio.run(main())
    paid = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 402]
    assert len(paid) + len(refused) == 200
    # what the budget covers: the requests alternate between the gateways, 100 each, and a
    # budget kept per gateway would pay up to 50 on each. Which gateway pays the 50 is a race
    # (one may spend it all before the other's first reservation lands), so it is not asserted.
    assert len(paid) == 50
    billed = sum(a.body["usage"]["cost"]["total"] for a in paid)
    assert billed <= BUDGET
    assert refused[0].body["error"]["code"] == "insufficient_quota"
    assert ledger_ids(fleet, "spender") == sorted(a.body["id"] for a in paid)  # one row each
    (spent,) = pg_query(fleet, "SELECT spent FROM budget_periods WHERE tenant = 'spender'")[0]
    assert spent <= Decimal(repr(BUDGET)) and float(spent) == pytest.approx(billed, rel=1e-9)
    assert held(fleet, "spender") == (0, 0)
    assert reserved_gauges(fleet) == 0
    for gw in fleet.gws:  # either gateway's /admin/usage reads the one shared ledger
        status, body = gw.get("/admin/usage?period=all&tenant=spender", "sk-ops")
        (total,) = orjson.loads(body)["data"]
        assert status == 200 and total["requests"] == 50
        assert total["cost_total"] == pytest.approx(billed, rel=1e-12)


def test_a_request_rate_holds_across_both_gateways(fleet):
    async def main():
        async with client() as s:
            began = time.monotonic()
            answers = await asyncio.gather(*(post(s, fleet, i, "sk-paced",
                                                  {"prompt": PROMPT, "max_tokens": 1})
                                             for i in range(40)))
            return answers, time.monotonic() - began
    answers, elapsed = asyncio.run(main())
    admitted = [a for a in answers if a.status == 200]
    limited = [a for a in answers if a.status == 429]
    # a bucket of RPM that refills at RPM a minute: at most RPM plus what refilled meanwhile,
    # where a gateway each would have admitted RPM of its own 20
    assert RPM <= len(admitted) <= RPM + int(elapsed * RPM / 60)
    assert len(admitted) + len(limited) == 40
    assert all(int(a.headers["Retry-After"]) >= 1 for a in limited)
    assert set(Counter(a.gateway for a in limited)) == {0, 1}


# ---- a store goes away, and comes back ----------------------------------------------------
def test_redis_down_refuses_new_requests_and_service_resumes_by_itself(fleet):
    async def main():
        async with client() as s:
            running, running_id = await open_stream(s, fleet, 0, "sk-steady", 100)
            fleet.rd.kill()
            try:
                body = {"prompt": PROMPT, "max_tokens": 2}
                # steady is refused at its request rate, open (no limits) at its fair-share
                # start, after its budget was reserved: that reservation must come back
                refused = [await post(s, fleet, i, key, body)
                           for i in range(6) for key in ("sk-steady", "sk-open")]
                finished = await finish_stream(running)
            finally:
                fleet.rd.start()  # empty, as a Redis that lost its data
            resumed = {key: await until_served(s, fleet, key)
                       for key in ("sk-steady", "sk-open")}
            return running_id, refused, finished, resumed

    running_id, refused, finished, resumed = asyncio.run(main())
    assert_refused_closed(refused)
    assert finished == (True, [])  # what was running when Redis died finished, and is billed
    served = {key: [a.body["id"] for a in answers if a.status == 200]
              for key, answers in resumed.items()}
    assert all(a.status in (200, 503) for answers in resumed.values() for a in answers)
    assert [len(ids) for ids in served.values()] == [2, 2]  # one on each gateway
    # one row for each request admitted, none for any refused
    assert ledger_ids(fleet, "steady") == sorted([running_id] + served["sk-steady"])
    assert ledger_ids(fleet, "open") == sorted(served["sk-open"])
    assert wait_for(lambda: held(fleet, "open") == (0, 0), 10)  # refusals gave theirs back
    assert held(fleet, "steady") == (0, 0)


def test_postgres_down_refuses_new_requests_bills_what_ran_and_resumes(fleet):
    async def main():
        async with client() as s:
            streams = [await open_stream(s, fleet, i, "sk-durable", 150) for i in range(4)]
            fleet.pg.kill()
            try:
                refused = [await post(s, fleet, i, "sk-durable",
                                      {"prompt": PROMPT, "max_tokens": 2}) for i in range(6)]
                finished = [await finish_stream(r) for r, _ in streams]
                reserved_while_down = reserved_gauges(fleet)
                usage_while_down = await asyncio.to_thread(
                    fleet.gws[0].get, "/admin/usage?period=all", "sk-ops")
            finally:
                fleet.pg.start()
            resumed = await until_served(s, fleet, "sk-durable")
            return ([i for _, i in streams], refused, finished, reserved_while_down, resumed,
                    usage_while_down)

    ran, refused, finished, reserved_while_down, resumed, usage = asyncio.run(main())
    assert_refused_closed(refused)
    # the ledger cannot be read: a 503 with the OpenAI error body, not a 500
    assert usage[0] == 503, usage
    assert orjson.loads(usage[1])["error"]["code"] == "store_unavailable"
    assert finished == [(True, [])] * 4  # their bills went to the outbox, so they ended well
    assert reserved_while_down > 0  # reserved until the settlement reaches PostgreSQL
    served = [a.body["id"] for a in resumed if a.status == 200]
    assert len(served) == 2
    expected = sorted(ran + served)
    assert wait_for(lambda: ledger_ids(fleet, "durable") == expected), ledger_ids(fleet,
                                                                                    "durable")
    assert wait_for(lambda: held(fleet, "durable") == (0, 0))
    assert wait_for(lambda: reserved_gauges(fleet) == 0)
