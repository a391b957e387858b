"""Soak: mixed load at about 70% of capacity (6 closed-loop users on 8 request slots).

The fast part (`test_mini_soak`, in `make test`) runs it for 10 s: no errors, back to
baseline. `test_soak` (marker `soak`, skipped unless RELIABILITY_SOAK=1, as `make soak` sets)
runs RELIABILITY_SOAK_MINUTES (3 by default; 30 for the full soak) and
also asserts resident memory grows under 5% (median of the last fifth against the first fifth
after warm-up) and p99 latency is stable (last third within 1.5x + 50 ms of the first third).
The figures are printed and, with RELIABILITY_REPORT=path, written there as JSON.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import aiohttp
import pytest

from numeric.percentiles import percentile
from tests.reliability.conftest import auth

USERS = 6  # of 8 slots: about 70% of capacity


async def user(s, url, rng, stop, records):
    key = rng.choice(["sk-alpha", "sk-beta", "sk-storm"])
    while not stop.is_set():
        kind = rng.choice(["sse-chat", "sse-comp", "json", "ws", "cancel"])
        max_tokens = rng.randint(4, 40)
        body = {"messages": [{"role": "user", "content": "soak " * rng.randint(1, 60)}],
                "max_tokens": max_tokens}
        t0 = time.monotonic()
        ok = True
        try:
            if kind == "ws":
                async with s.ws_connect(url + "/v1/ws", headers=auth(key)) as ws:
                    await ws.send_json({"type": "request", "id": "r", "body": body})
                    while True:
                        msg = json.loads((await ws.receive(timeout=30)).data)
                        if msg["type"] in ("done", "error"):
                            ok = msg["type"] == "done"
                            break
            else:
                path = "/v1/completions" if kind == "sse-comp" else "/v1/chat/completions"
                if kind == "sse-comp":
                    body = {"prompt": body["messages"][0]["content"], "max_tokens": max_tokens}
                stream = kind != "json"
                async with s.post(url + path, json={**body, "stream": stream},
                                  headers=auth(key)) as r:
                    ok = r.status == 200
                    if stream and ok:
                        seen = 0
                        async for line in r.content:
                            if line.startswith(b"data: [DONE]"):
                                break
                            ok = ok and b'"error"' not in line
                            seen += 1
                            if kind == "cancel" and seen >= 3:
                                break  # the client walks away: not an error
                    else:
                        await r.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok = False
            records.append({"kind": kind, "ok": False, "error": repr(exc), "t": t0})
            continue
        records.append({"kind": kind, "ok": ok, "latency": time.monotonic() - t0, "t": t0})


def test_mini_soak(tmp_path):
    run_soak(tmp_path, 10 / 60, strict=False)


SOAK_MINUTES = float(os.environ.get("RELIABILITY_SOAK_MINUTES", "3"))


@pytest.mark.soak
@pytest.mark.timeout(SOAK_MINUTES * 60 + 300)  # the suite's 600 s limit would cut a long soak
def test_soak(tmp_path):
    run_soak(tmp_path, SOAK_MINUTES, strict=True)


def run_soak(tmp_path, minutes: float, strict: bool) -> None:
    from tests.reliability.conftest import Gateway
    gw = Gateway(tmp_path, "--fake-step-ms", "5", "--max-num-seqs", "8")
    rss: list[tuple[float, int]] = []
    try:
        async def main():
            stop = asyncio.Event()
            records: list[dict] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                rng = random.Random(7)
                tasks = [asyncio.create_task(user(s, gw.url, random.Random(rng.random()),
                                                  stop, records)) for _ in range(USERS)]
                start = time.monotonic()
                while time.monotonic() - start < minutes * 60:
                    rss.append((time.monotonic() - start, gw.rss_bytes()))
                    if strict and len(rss) % 12 == 0:  # progress of a long soak, each minute
                        print(f"soak: {rss[-1][0] / 60:.0f} min, {len(records)} requests, "
                              f"RSS {rss[-1][1] / 2**20:.1f} MiB", flush=True)
                    await asyncio.sleep(min(5.0, minutes * 60 / 20))
                stop.set()
                await asyncio.wait(tasks, timeout=60)
            return records, start
        records, start = asyncio.run(main())
        gw.assert_baseline()
    finally:
        gw.stop()
    errors = [r for r in records if not r["ok"]]
    lat = [(r["t"] - start, r["latency"]) for r in records if r["ok"]]
    span = minutes * 60
    thirds = [[v for t, v in lat if k * span / 3 <= t < (k + 1) * span / 3] for k in range(3)]
    fifth = max(1, len(rss) // 5)
    rss_start = statistics.median(v for _, v in rss[fifth:2 * fifth] or rss[:1])
    rss_end = statistics.median(v for _, v in rss[-fifth:])
    report = {"minutes": minutes, "requests": len(records), "errors": len(errors),
              "requests_per_second": round(len(records) / span, 1),
              "p50_s": round(percentile([v for _, v in lat], 50), 4),
              "p99_s_by_third": [round(percentile(t, 99), 4) for t in thirds],
              "rss_mib_start": round(rss_start / 2**20, 1),
              "rss_mib_end": round(rss_end / 2**20, 1),
              "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2)}
    print("soak:", json.dumps(report))
    if os.environ.get("RELIABILITY_REPORT"):
        with open(os.environ["RELIABILITY_REPORT"], "w") as fh:
            json.dump(report, fh, indent=1)
    assert not errors, errors[:5]
    assert len(records) > 20
    if strict:
        assert report["rss_growth_pct"] < 5, report
        p99 = report["p99_s_by_third"]
        assert p99[2] <= 1.5 * p99[0] + 0.05, report

