"""Disconnect storm: 500 streams cut at random points; nothing leaks, each is billed right."""
from __future__ import annotations

import asyncio
import random

import aiohttp

from tests.reliability.conftest import PRICES, auth

STREAMS = 500
CONCURRENCY = 100


async def one(session, url, rng: random.Random) -> dict:
    """Cut while queued or before the first token (no headers yet: the SSE answer opens with
    the first token), or mid-decode after k chunks, or never."""
    where = rng.choice(["early", "early", "decode", "decode", "decode", "full"])
    max_tokens = rng.randint(5, 60)
    body = {"prompt": "storm " * rng.randint(1, 200), "max_tokens": max_tokens,
            "stream": True}
    rec = {"where": where, "max_tokens": max_tokens, "id": None, "chunks": 0, "done": False}

    async def run():
        async with session.post(url + "/v1/completions", json=body,
                                headers=auth("sk-storm")) as r:
            assert r.status == 200, await r.text()
            rec["id"] = r.headers["x-request-id"]
            cut_after = rng.randint(1, max_tokens) if where == "decode" else None
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    rec["done"] = True
                    return
                if line.startswith(b"data: ") and b'"finish_reason":null' in line \
                        and (b'"text":"' in line and b'"text":""' not in line):
                    rec["chunks"] += 1
                    if cut_after is not None and rec["chunks"] >= cut_after:
                        return  # leaving the context closes the connection mid-decode
    if where == "early":
        try:
            await asyncio.wait_for(run(), rng.uniform(0.0, 0.3))
        except TimeoutError:
            pass
    else:
        await asyncio.wait_for(run(), 60)
    return rec


def test_disconnect_storm(gw):
    rng = random.Random(1234)
    before = {r["id"] for r in gw.ledger_rows("tenant = 'storm'")}

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)
        conn = aiohttp.TCPConnector(limit=CONCURRENCY, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def guarded(i):
                async with sem:
                    return await one(s, gw.url, random.Random(rng.random()))
            return await asyncio.gather(*(guarded(i) for i in range(STREAMS)))
    records = asyncio.run(main())
    gw.assert_baseline()  # no leaked block, reservation or queue entry (also after the test)

    rows = {r["id"]: r for r in gw.ledger_rows("tenant = 'storm'") if r["id"] not in before}
    assert len(rows) <= STREAMS
    by_where = {}
    for rec in records:
        by_where.setdefault(rec["where"], []).append(rec)
        if rec["id"] is None:
            continue  # cut before the answer began: its row is checked below by status
        row = rows[rec["id"]]
        # billed for what it produced: at least what the client saw, at most its budget
        assert rec["chunks"] <= row["output_tokens"] <= rec["max_tokens"], (rec, row)
        if rec["done"]:
            assert row["status"] == "ok" and row["output_tokens"] == rec["max_tokens"]
        assert row["cache_hit_tokens"] + row["cache_miss_tokens"] > 0  # prompt billed
    for row in rows.values():
        assert row["status"] in ("ok", "cancelled"), row
        if row["status"] == "cancelled" and row["output_tokens"] == 0 \
                and row["cache_hit_tokens"] + row["cache_miss_tokens"] == 0:
            assert row["cost_total"] == 0  # left the queue before any worker saw it
        expect = PRICES.cost(row["cache_hit_tokens"], row["cache_miss_tokens"],
                             row["output_tokens"], row["price_multiplier"]).total
        assert abs(expect - row["cost_total"]) < 1e-12
    cut = [r for r in rows.values() if r["status"] == "cancelled"]
    assert len(cut) > STREAMS // 3  # the storm really cut most streams
    assert any(r["output_tokens"] == 0 for r in cut)  # some were cut before any token
    assert any(r["output_tokens"] > 0 for r in cut)  # and some mid-decode
    # the revenue the gateway reports for the tenant reconciles with its ledger rows
    revenue = sum(float(line.rsplit(" ", 1)[1]) for line in
                  gw.get("/metrics", gw.admin_key)[1].decode().splitlines()
                  if line.startswith("inferstack:revenue_usd_total{")
                  and 'tenant="storm"' in line)
    ledger = sum(r["cost_total"] for r in gw.ledger_rows("tenant = 'storm'"))
    assert abs(revenue - ledger) < 1e-9, (revenue, ledger)
    # and the token metrics count every request the way the bill does, cut ones included
    # (they are the gateway's totals: the storm's rows plus the baseline checks' requests)
    all_rows = gw.ledger_rows()
    totals = gw.metrics(["vllm:generation_tokens_total", "vllm:prompt_tokens_total"])
    assert totals["vllm:generation_tokens_total"] == sum(r["output_tokens"] for r in all_rows)
    assert totals["vllm:prompt_tokens_total"] == sum(
        r["cache_hit_tokens"] + r["cache_miss_tokens"] for r in all_rows)
    print({k: len(v) for k, v in by_where.items()}, "rows", len(rows), "cancelled", len(cut))
