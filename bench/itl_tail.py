"""The inter-token tail under new prompts (issue 35): `vllm bench serve`'s random workload
streamed through the gateway, with the inter-token budget off and on, side by side.

    python -m bench.itl_tail                          # 8 streams, 32 requests, 256 -> 64 tokens
    python -m bench.itl_tail --budgets off,auto,60    # also a fixed 60 ms target
    python -m bench.itl_tail --requests 4 --concurrency 2 --prompt-tokens 32 --output-tokens 8

Each budget is a gateway started as `make run` starts it (`python -m gateway`, the real
SmolLM2 model) plus `--itl-target-ms` (0 for off, nothing for the automatic target, or a number
of ms); servers run one at a time, alternating over --rounds, so a neighbour's burst hits both
alike. The client is a closed loop as `vllm bench serve --max-concurrency C` is: C users each
send a request (random token ids as the prompt, EOS ignored, streamed) and the next as soon as
the last ends. Per stream it records the time to first token and every gap between streamed
chunks (one token each). Reported per budget, the median over rounds of: inter-token latency
p50 and p99 and their ratio, median TTFT, and output tokens/s (usage's completion tokens over
the wall time from the first send to the last token). Target: p99 at most 2x the median, the
median TTFT no worse than with the budget off.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from bench.engine_servers import start_ours
from bench.gateway_servers import REPO_ROOT

BUDGET_FLAGS = {"off": ["--itl-target-ms", "0"], "auto": []}


def budget_flags(name: str) -> list[str]:
    """The gateway flags of a budget: off, auto, or a target in ms."""
    if name in BUDGET_FLAGS:
        return BUDGET_FLAGS[name]
    if float(name) <= 0:
        raise SystemExit(f"--budgets: {name!r} is not off, auto or a positive number of ms")
    return ["--itl-target-ms", name]


async def _stream(session, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    import orjson
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "stream": True, "ignore_eos": True, "temperature": 0.0,
                         "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with session.post(url + "/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            if any(c.get("text") for c in event.get("choices") or ()):
                times.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"t0": t0, "times": times, "tokens": tokens or len(times)}


async def _closed_loop(url: str, concurrency: int, prompts: list[list[int]],
                       max_tokens: int) -> tuple[list[dict], float]:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    queue = list(prompts)
    done: list[dict] = []

    async def user() -> None:
        while queue:
            done.append(await _stream(session, url, model, queue.pop(0), max_tokens))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        await _stream(session, url, model, prompts[0][:16], 4)  # warm: first-request paths
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return done, wall


def summarize(done: list[dict], wall: float) -> dict:
    from bench.common import percentile
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]
    ttft = [r["times"][0] - r["t0"] for r in done if r["times"]]
    p50, p99 = percentile(itl, 50), percentile(itl, 99)
    return {"itl_p50_ms": 1e3 * p50, "itl_p99_ms": 1e3 * p99, "p99_over_p50": p99 / p50,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "output_tok_s": sum(r["tokens"] for r in done) / wall, "wall_s": wall,
            "requests": len(done)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="off,auto",
                   help="comma-separated: off, auto, or a target in ms (each its own gateway)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="alternations of the budgets")
    p.add_argument("--model", default=None, help="a .gguf or HF folder (default: SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/itl_tail.json"))
    a = p.parse_args(argv)
    from bench.common import fmt, log, machine_info, markdown_table, median, write_json

    budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    for b in budgets:
        budget_flags(b)  # refused before any server starts
    rng = random.Random(a.seed)
    # random ids above the special tokens, as vLLM's random dataset draws them
    prompts = [[rng.randrange(1000, 40000) for _ in range(a.prompt_tokens)]
               for _ in range(a.requests)]
    runs: dict[str, list[dict]] = {b: [] for b in budgets}
    for r in range(a.rounds):
        for b in budgets:
            log(f"[itl_tail] round {r + 1}: budget {b}: starting the gateway ...")
            server = start_ours(a.model, budget_flags(b))
            try:
                done, wall = asyncio.run(_closed_loop(server.url, a.concurrency, prompts,
                                                      a.output_tokens))
            finally:
                server.stop()
            result = summarize(done, wall)
            log(f"  ITL p50 {result['itl_p50_ms']:.1f} ms, p99 {result['itl_p99_ms']:.1f} ms, "
                f"TTFT p50 {result['ttft_p50_ms']:.0f} ms, {result['output_tok_s']:.1f} tok/s")
            runs[b].append(result)
    keys = ["itl_p50_ms", "itl_p99_ms", "p99_over_p50", "ttft_p50_ms", "output_tok_s"]
    medians = {b: {k: median([x[k] for x in runs[b]]) for k in keys} for b in budgets}
    rows = [[b, *(fmt(medians[b][k], 1) for k in keys)] for b in budgets]
    table = markdown_table(["budget", "ITL p50 ms", "ITL p99 ms", "p99 / p50", "TTFT p50 ms",
                            "output tok/s"], rows)
    info = machine_info()
    print(f"\n{a.concurrency} streams, {a.requests} requests of {a.prompt_tokens} prompt -> "
          f"{a.output_tokens} output tokens; {info['cpu']}, {info['cores']} cores; median of "
          f"{a.rounds} round(s)\n")
    print(table)
    if "off" in medians:
        for b in budgets:
            m = medians[b]
            if b != "off":
                ok = m["p99_over_p50"] <= 2.0 and m["ttft_p50_ms"] <= medians["off"]["ttft_p50_ms"]
                print(f"{b}: p99 <= 2x p50 and TTFT p50 <= off's: {'met' if ok else 'NOT met'}")
    write_json(a.out, {"benchmark": "itl_tail", "args": vars(a), "machine": info,
                       "runs": runs, "medians": medians, "table_markdown": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
