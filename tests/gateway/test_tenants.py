"""Keys, rate limits, budgets, fair share, isolation and the ledger on a real gateway."""
import asyncio
import sqlite3

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file

TENANTS = {
    "alpha": {"weight": 1.0}, "beta": {"weight": 3.0},
    "limited": {"requests_per_minute": 2},
    "thrifty": {"budget_usd": 0.00005},  # about 8 requests of 10 output tokens at seed prices
    "ops": {},
}
KEYS = [("sk-alpha", "alpha", False, False), ("sk-beta", "beta", False, False),
        ("sk-limited", "limited", False, False), ("sk-thrifty", "thrifty", False, False),
        ("sk-admin", "ops", True, False), ("sk-revoked", "alpha", False, True)]


def key_file(path):
    return write_key_file(path, TENANTS, KEYS)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    ledger = str(tmp / "ledger.sqlite3")
    server = GatewayProcess("--fake", "--fake-step-ms", "4", "--max-num-seqs", "1",
                            "--keys-file", key_file(tmp / "keys.toml"), "--prices", "seed",
                            "--ledger-path", ledger, "--fair-share-tokens-per-second", "100")
    server.ledger = ledger
    yield server
    server.stop()


async def post(session, url, key, body, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url + path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(), asyncio.get_running_loop().time()


def run(coro):
    return asyncio.run(coro)


def test_keys_401_and_admin_only(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "x", "max_tokens": 1}
            out = [await post(s, gw.url, k, body) for k in (None, "sk-wrong", "sk-revoked",
                                                            "sk-alpha")]
            async with s.get(gw.url + "/admin/usage",
                             headers={"Authorization": "Bearer sk-alpha"}) as r:
                out.append((r.status, await r.json()))
            async with s.get(gw.url + "/admin/usage",
                             headers={"Authorization": "Bearer sk-admin"}) as r:
                out.append((r.status, await r.json()))
            return out
    none, wrong, revoked, ok, not_admin, admin = run(main())
    for status, _, body, _ in (none, wrong, revoked):
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert ok[0] == 200
    assert not_admin[0] == 403
    assert admin[0] == 200 and admin[1]["object"] == "list"


def test_rate_limit_answers_429_with_retry_after(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            return [await post(s, gw.url, "sk-limited", {"prompt": "x", "max_tokens": 1})
                    for _ in range(3)]
    results = run(main())
    assert [r[0] for r in results] == [200, 200, 429]
    assert int(results[2][1]["Retry-After"]) >= 1


def test_concurrent_requests_cannot_overspend_a_budget(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "x", "max_tokens": 10}
            return await asyncio.gather(*(post(s, gw.url, "sk-thrifty", body)
                                          for _ in range(100)))
    results = run(main())
    paid = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 402]
    assert len(paid) + len(refused) == 100 and paid and refused
    spent = sum(r[2]["usage"]["cost"]["total"] for r in paid)
    assert spent <= TENANTS["thrifty"]["budget_usd"]
    assert refused[0][2]["error"]["code"] == "insufficient_quota"
    assert gw.metric("inferstack:budget_reserved_usd") == pytest.approx(0, abs=1e-12)


def test_fair_share_between_two_tenants_follows_weights(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "x", "max_tokens": 8}
            tasks = [asyncio.create_task(post(s, gw.url, "sk-alpha", body)) for _ in range(30)]
            tasks += [asyncio.create_task(post(s, gw.url, "sk-beta", body)) for _ in range(30)]
            results = await asyncio.gather(*tasks)
            return [("alpha" if i < 30 else "beta", r[3]) for i, r in enumerate(results)]
    finished = sorted(run(main()), key=lambda x: x[1])
    contended = [name for name, _ in finished[:32]]  # both tenants still have a backlog
    share = contended.count("beta") / len(contended)
    assert 0.75 * 0.8 <= share <= min(1.0, 0.75 * 1.2), contended


def test_cross_tenant_prefixes_report_no_cached_tokens(gw):
    prompt = "A shared system prompt that is long enough to fill several blocks. " * 8

    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": prompt, "max_tokens": 1}
            first = await post(s, gw.url, "sk-alpha", body)
            other = await post(s, gw.url, "sk-beta", body)
            again = await post(s, gw.url, "sk-alpha", body)
            return first, other, again
    first, other, again = run(main())
    cached = lambda r: r[2]["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(first) == 0 and cached(other) == 0 and cached(again) > 0


def test_ledger_totals_equal_what_clients_were_billed(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            billed = []
            for i in range(5):
                r = await post(s, gw.url, "sk-admin", {"prompt": f"q{i}", "max_tokens": 4 + i})
                billed.append(r[2]["usage"]["cost"]["total"])
            # a cancelled stream: billed for what it produced, which the client never saw
            resp = await s.post(gw.url + "/v1/completions",
                                json={"prompt": "long", "max_tokens": 3000, "stream": True},
                                headers={"Authorization": "Bearer sk-admin"})
            await resp.content.readline()
            resp.close()
            await asyncio.sleep(1.0)
            async with s.get(gw.url + "/admin/usage?period=all&tenant=ops",
                             headers={"Authorization": "Bearer sk-admin"}) as r:
                return billed, await r.json()
    billed, usage = run(main())
    db = sqlite3.connect(gw.ledger)
    rows = db.execute("SELECT status, cost_total, output_tokens FROM requests "
                      "WHERE tenant = 'ops'").fetchall()
    ok = [r for r in rows if r[0] == "ok"]
    cancelled = [r for r in rows if r[0] == "cancelled"]
    assert len(ok) == 5 and sum(r[1] for r in ok) == pytest.approx(sum(billed), rel=1e-12)
    assert len(cancelled) == 1 and cancelled[0][2] >= 1 and cancelled[0][1] > 0
    total = usage["data"][0]
    assert total["requests"] == 6
    assert total["cost_total"] == pytest.approx(sum(r[1] for r in rows), rel=1e-12)
