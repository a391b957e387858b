"""Prefill/decode disaggregation against colocation, side by side in one run, on the real
model through real gateways (`python -m gateway`), on the same cores.

  colocated      `--workers 1`, every core to the one worker;
  disaggregated  `--pd 1:1`, the cores split between a prefill and a decode worker, prompt KV
                 moved over gloo.

Workload (greedy, EOS ignored): S short streams start together and decode T tokens each;
while they decode, L long prompts (P tokens of distinct filler text, so no prefix hits)
arrive one every G seconds, each asking for a few tokens. Measured at the client, per SSE
chunk: inter-token latency of the decoding streams (p50, p99; the long prefills are what
stalls them when colocated), time to first token of the long prompts and of the streams,
and output throughput (all output tokens / wall time of the run). The transfer time per
request comes from the gateway's `inferstack:kv_transfer_seconds` metric.

    python -m bench.disagg --quick     # about 2 minutes on 2 cores (one round)
    python -m bench.disagg             # about 5 minutes (two rounds, each mode's best)
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time

import aiohttp

from bench import common
from bench.common import fmt, log, markdown_table, percentile
from loadtest.text import words
from testkit.gateway_server import GatewayProcess


async def stream(session, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, stamps, tokens = time.perf_counter(), [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start if stamps else None,
            "itl": [b - a for a, b in itertools.pairwise(stamps)], "tokens": tokens}


async def workload(url: str, a, seed: int) -> dict:
    rng = random.Random(seed)
    longs = [words(random.Random(seed * 1000 + i), a.long_tokens) for i in range(a.longs)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await stream(s, url, "warm up", 2)
        start = time.perf_counter()
        streams = [asyncio.create_task(stream(s, url, words(rng, 12), a.stream_tokens))
                   for _ in range(a.streams)]
        await asyncio.sleep(a.gap)
        long_tasks = []
        for prompt in longs:
            long_tasks.append(asyncio.create_task(stream(s, url, prompt, a.long_out)))
            await asyncio.sleep(a.gap)
        done_streams = await asyncio.gather(*streams)
        done_longs = await asyncio.gather(*long_tasks)
        wall = time.perf_counter() - start
    itl = [x for d in done_streams for x in d["itl"]]
    tokens = sum(d["tokens"] for d in done_streams + done_longs)
    return {"itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
            "itl_max_ms": 1000 * max(itl),
            "ttft_long_p50_s": percentile([d["ttft"] for d in done_longs], 50),
            "ttft_stream_p50_s": percentile([d["ttft"] for d in done_streams], 50),
            "throughput_tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens}


def run_mode(name: str, flags: list[str], a) -> dict:
    log(f"{name}: starting gateway {' '.join(flags)}")
    gw = GatewayProcess("--kv-cache-gb", "0.25", "--max-num-batched-tokens",
                        str(a.batched_tokens), *flags, ready_timeout=600)
    try:
        deadline = time.monotonic() + 600
        while None in json.loads(gw.get("/ready")[1])["worker_pids"]:
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.5)
        result = asyncio.run(workload(gw.url, a, seed=1))
        n = gw.metric("inferstack:kv_transfer_seconds_count")
        if n:
            result["kv_transfer_ms_mean"] = 1000 * gw.metric(
                "inferstack:kv_transfer_seconds_sum") / n
            result["kv_transfer_mb_total"] = gw.metric("inferstack:kv_transfer_bytes_total") / 1e6
    finally:
        gw.stop()
        gw.proc.wait(60)
    log(f"{name}: {result}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--longs", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1000)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--gap", type=float, default=1.5, help="seconds between long prompts")
    p.add_argument("--batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    p.add_argument("--out", default="bench/results/disagg.json")
    a = p.parse_args()
    if a.quick:
        a.streams, a.stream_tokens, a.longs, a.long_tokens, a.gap = 4, 48, 2, 600, 1.0
        a.rounds = 1
    cores = common.num_cores()
    modes = {"colocated": ["--workers", "1", "--threads-per-worker", str(cores)],
             "disaggregated 1:1": ["--pd", "1:1", "--threads-per-worker",
                                   str(max(1, cores // 2))]}
    rounds: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(a.rounds):  # alternate the modes, so a noisy spell hits both
        for name, flags in modes.items():
            rounds[name].append(run_mode(name, flags, a))
    # each mode's best round (highest throughput): the closest to what the cores can do
    results = {name: max(rs, key=lambda r: r["throughput_tok_s"])
               for name, rs in rounds.items()}
    cols = ["itl_p50_ms", "itl_p99_ms", "itl_max_ms", "ttft_stream_p50_s", "ttft_long_p50_s",
            "throughput_tok_s", "kv_transfer_ms_mean"]
    rows = [[name] + [fmt(r.get(c)) for c in cols] for name, r in results.items()]
    base, pd = results["colocated"], results["disaggregated 1:1"]
    rows.append(["disagg / colocated"] + [fmt(pd[c] / base[c]) if base.get(c) else "-"
                                          for c in cols])
    print(markdown_table(["mode"] + cols, rows))
    out = common.write_json(a.out, {"machine": common.machine_info(), "args": vars(a),
                                    "results": results, "rounds": rounds})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
