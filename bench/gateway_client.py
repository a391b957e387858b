"""The streaming client of bench/gateway.py: bursts or steady load of SSE completion streams over
keep-alive connections, with TTFT, inter-token gaps and CPU seconds of client and server.
"""
from __future__ import annotations

import asyncio
import time

from bench.gateway_servers import ServerProcess


# ---- the client -----------------------------------------------------------------------------
async def _one_stream(session, url: str, tokens: int, stats: dict) -> dict:
    import orjson
    body = orjson.dumps({"prompt": "x", "max_tokens": tokens, "stream": True})
    times: list[float] = []
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                stats["errors"] += 1
                return {"t0": t0, "times": [], "text": "", "status": resp.status}
            queued = resp.headers.get("x-queue-seconds")  # the gateway's own queue time
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                now = time.perf_counter()
                piece = orjson.loads(line[6:])["choices"][0]["text"]
                if piece:
                    times.append(now)
                    text.append(piece)
    except Exception as e:  # noqa: BLE001 - a failed stream is counted, not fatal
        stats["errors"] += 1
        return {"t0": t0, "times": times, "text": "".join(text), "status": repr(e)}
    return {"t0": t0, "times": times, "text": "".join(text), "status": 200,
            "queued": None if queued is None else float(queued)}


async def _prewarm(session, url: str, n: int) -> None:
    """Open n keep-alive connections (n concurrent GETs) so the timed requests start on open
    connections: a burst of 1,024 connects into a 128-entry listen backlog would otherwise put
    SYN retransmits (1 s) into both systems' TTFT and hide the machinery being measured."""
    async def get():
        async with session.get(url + "/ready") as r:
            await r.read()
    await asyncio.gather(*(get() for _ in range(n)))


async def _run_load(url: str, concurrency: int, tokens: int, prewarm: bool,
                    steady: tuple[float, float] | None = None) -> dict:
    """All streams at once (a burst), or with `steady` = (ramp s, window s): each of the
    `concurrency` clients starts at a random moment of the ramp and then runs one stream
    after another; only streams started inside the window after the ramp count."""
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
    stats = {"errors": 0}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if prewarm:
            await _prewarm(session, url, concurrency)
        cpu0, t0 = time.process_time(), time.perf_counter()
        if steady is None:
            results = await asyncio.gather(*(_one_stream(session, url, tokens, stats)
                                             for _ in range(concurrency)))
        else:
            results = await _steady(session, url, concurrency, tokens, stats, t0, *steady)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if steady is not None:
            wall -= steady[0]  # tokens/s over the window: only streams started in it count
    return {"results": results, "wall": wall, "client_cpu": cpu, "errors": stats["errors"]}


async def _steady(session, url: str, concurrency: int, tokens: int, stats: dict, t0: float,
                  ramp: float, window: float) -> list[dict]:
    import random
    rng = random.Random(0)

    async def client(delay: float) -> list[dict]:
        await asyncio.sleep(delay)
        done = []
        while time.perf_counter() - t0 < ramp + window:
            done.append(await _one_stream(session, url, tokens, stats))
        return done
    runs = await asyncio.gather(*(client(rng.uniform(0, ramp)) for _ in range(concurrency)))
    return [r for run in runs for r in run if r["t0"] - t0 >= ramp]


def measure(server: ServerProcess, concurrency: int, tokens: int, prewarm: bool,
            steady: tuple[float, float] | None = None) -> dict:
    import uvloop

    from bench.common import percentile
    srv_cpu0 = server.cpu_seconds()
    run = uvloop.run(_run_load(server.url, concurrency, tokens, prewarm, steady))
    srv_cpu = server.cpu_seconds() - srv_cpu0
    ttft, itl, total, short = [], [], 0, 0
    texts = set()
    queued = [r["queued"] for r in run["results"] if r.get("queued") is not None]
    for r in run["results"]:
        ts = r["times"]
        total += len(ts)
        short += len(ts) < tokens
        if ts:
            ttft.append(ts[0] - r["t0"])
            itl += [b - a for a, b in zip(ts, ts[1:])]
            texts.add(r["text"])
    ms = 1000.0
    wall = run["wall"]
    return {
        "system": server.name, "concurrency": concurrency, "tokens_per_stream": tokens,
        "streams_ok": len(run["results"]) - run["errors"], "errors": run["errors"],
        "short_streams": short, "tokens": total, "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": percentile(ttft, 50) * ms, "ttft_p99_ms": percentile(ttft, 99) * ms,
        "ttft_max_ms": max(ttft) * ms if ttft else float("nan"),
        "itl_p50_ms": percentile(itl, 50) * ms, "itl_p99_ms": percentile(itl, 99) * ms,
        "gateway_queue_p99_ms": percentile(queued, 99) * ms if queued else None,
        "client_cpu_s": run["client_cpu"], "client_cpu_share": run["client_cpu"] / wall,
        "server_cpu_s": srv_cpu, "server_cpu_share": srv_cpu / wall,
        "distinct_texts": sorted(texts)[:2],
    }

