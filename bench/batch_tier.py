"""The batch tier's benchmark (issue 37): a compressed day of online traffic, with and without
a batch backlog filling the idle capacity, side by side (not collected by pytest).

Each run starts its own gateway on the real model (SmolLM2), drives online chat traffic
whose rate follows a day's curve from a quarter of capacity to full (the load tester's
`--arrival-profile day`), and reads the live feed's snapshot (/admin/telemetry) at the day's
start and end: worker-busy seconds (split by tier), worker-seconds and revenue by tier. The
run with the tier first uploads a backlog through the Files and Batch API with the official
`openai` client, large enough to outlast the day, and cancels what is left at the end.

Reported per run: GPU-busy fraction, revenue per GPU-hour, the online TTFT p50/p99 and ITL
p99, batch lines done; then the ratios. Targets: busy fraction > 95% with the tier, online
TTFT p99 and ITL p99 within 10% of the run without it.

    python -m bench.batch_tier                      # a 240 s day, capacity measured first
    python -m bench.batch_tier --day-seconds 60 --capacity 2 --batch-lines 200
    python -m bench.batch_tier --fake --day-seconds 20 --capacity 20   # the fake engine
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time

import aiohttp
import openai
import orjson
from openai import OpenAI

from bench.loadtest import RESULTS, Gateway
from loadtest.day_profile import DEFAULT_CURVE, DayProfile
from loadtest.dists import Dist
from loadtest.mix import Mix
from loadtest.pricing import PriceBook
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load
from loadtest.slo import SLO
from loadtest.workloads import WorkloadParams

TARGET_BUSY = 0.95
TARGET_LATENCY_RATIO = 1.10
BATCH_PROMPTS = ("Summarise the history of the printing press in a paragraph.",
                 "List ten uses of a paperclip, one a line.",
                 "Explain how a refrigerator works to a child.",
                 "Write a short poem about a lighthouse at dawn.")


async def feed_snapshot(url: str, timeout: float = 30.0) -> dict:
    """The live feed's first snapshot (the feed sends one as soon as it opens)."""
    ws_url = url.replace("http://", "ws://", 1) + "/admin/telemetry"
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = await ws.receive(timeout=timeout)
            frame = orjson.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {}
            if frame.get("type") == "snapshot":
                return frame
    raise TimeoutError("no snapshot on the live feed")


def totals(snapshot: dict) -> dict:
    """The running totals a day's figures are differences of."""
    tiers = snapshot.get("tiers", {})
    busy, revenue = tiers.get("busy_seconds", {}), tiers.get("revenue", {})
    return {"gpu_seconds": snapshot["revenue"]["gpu_seconds_total"],
            "busy_online": busy.get("online", 0.0), "busy_batch": busy.get("batch", 0.0),
            "revenue_online": revenue.get("online", 0.0),
            "revenue_batch": revenue.get("batch", 0.0)}


def batch_file(lines: int, max_tokens: int, model: str) -> bytes:
    out = io.BytesIO()
    for i in range(lines):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "user", "content": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]
                              + f" (variant {i})"}]}
        out.write(orjson.dumps({"custom_id": f"line-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + b"\n")
    return out.getvalue()


def start_backlog(url: str, lines: int, max_tokens: int):
    """Upload the backlog and create its batch with the official client."""
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    upload = client.files.create(file=("backlog.jsonl", batch_file(lines, max_tokens, model)),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    return client, batch.id


def online_settings(url: str, args: argparse.Namespace, capacity: float) -> Settings:
    day = DayProfile(capacity / 4, capacity, args.day_seconds, DEFAULT_CURVE)
    shape = LoadShape(rate=capacity, duration=args.day_seconds, grace=120, day=day)
    params = WorkloadParams(input_len=Dist.parse(args.input_len),
                            output_len=Dist.parse(args.output_len))
    return Settings(url, "random", shape, params, Mix.default(), seed=args.seed, slo=SLO(),
                    book=PriceBook.preset("seed", use_reported=True), gpus=1,
                    gpu_cost_per_hour=2.0)


def measure_capacity(url: str, args: argparse.Namespace) -> float:
    """Requests per second the gateway completes with every sequence slot busy."""
    params = WorkloadParams(input_len=Dist.parse(args.input_len),
                            output_len=Dist.parse(args.output_len))
    shape = LoadShape(concurrency=args.max_num_seqs, duration=args.capacity_seconds,
                      warmup=2.0, grace=120)
    result = asyncio.run(run_load(Settings(url, "random", shape, params, Mix.default(),
                                           seed=args.seed), progress=False))[0]
    return result["summary"]["throughput"]["requests_per_s"]


def one_day(args: argparse.Namespace, with_tier: bool, capacity: float) -> dict:
    with Gateway(*args.gateway_flags) as gw:
        client = batch_id = None
        if with_tier:
            client, batch_id = start_backlog(gw.url, args.batch_lines, args.batch_max_tokens)
        start = totals(asyncio.run(feed_snapshot(gw.url)))
        result = asyncio.run(run_load(online_settings(gw.url, args, capacity),
                                      progress=False))[0]
        end = totals(asyncio.run(feed_snapshot(gw.url)))
        lines_done = exhausted = None
        if client is not None and batch_id is not None:
            batch = client.batches.retrieve(batch_id)
            lines_done = batch.request_counts.completed if batch.request_counts else None
            # a backlog that ran out before the day's end left idle time: say so
            exhausted = batch.status not in ("validating", "in_progress")
            if not exhausted:
                try:
                    client.batches.cancel(batch_id)  # the rest is not this day's work
                except openai.ConflictError:  # it finished meanwhile
                    exhausted = True
    d = {k: end[k] - start[k] for k in end}
    s = result["summary"]
    busy = d["busy_online"] + d["busy_batch"]
    gpu_hours = d["gpu_seconds"] / 3600
    revenue = d["revenue_online"] + d["revenue_batch"]
    return {"tier": "with batch" if with_tier else "online only",
            "busy_fraction": busy / d["gpu_seconds"] if d["gpu_seconds"] else 0.0,
            "batch_busy_fraction": d["busy_batch"] / d["gpu_seconds"] if d["gpu_seconds"]
            else 0.0,
            "revenue_per_gpu_hour": revenue / gpu_hours if gpu_hours else 0.0,
            "ttft_p50_ms": s["latency_ms"]["ttft"]["p50"],
            "ttft_p99_ms": s["latency_ms"]["ttft"]["p99"],
            "itl_p99_ms": s["latency_ms"]["itl"]["p99"],
            "online_completed": s["requests"]["completed"],
            "online_failed": s["requests"]["failed"],
            "batch_lines_done": lines_done, "backlog_ran_out": exhausted}


def ratios(without: dict, with_tier: dict) -> dict:
    def ratio(key: str) -> float | None:
        return with_tier[key] / without[key] if without[key] else None
    out: dict = {k: ratio(k) for k in ("busy_fraction", "revenue_per_gpu_hour", "ttft_p50_ms",
                                       "ttft_p99_ms", "itl_p99_ms")}
    out["targets_met"] = {
        "busy_fraction_above_95pct": with_tier["busy_fraction"] > TARGET_BUSY,
        "ttft_p99_within_10pct": (out["ttft_p99_ms"] or 0) <= TARGET_LATENCY_RATIO,
        "itl_p99_within_10pct": (out["itl_p99_ms"] or 0) <= TARGET_LATENCY_RATIO}
    return out


def table(rows: list[dict]) -> str:
    cols = list(rows[0])

    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in cols) + " |"
                              for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--day-seconds", type=float, default=240.0, help="one compressed day")
    p.add_argument("--capacity", type=float,
                   help="online requests per second at full capacity (default: measured)")
    p.add_argument("--capacity-seconds", type=float, default=30.0,
                   help="length of the capacity measurement")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the workers' running batch")
    p.add_argument("--input-len", default="64", help="online prompt words")
    p.add_argument("--output-len", default="64", help="online max_tokens")
    p.add_argument("--batch-lines", type=int,
                   help="backlog lines (default: enough to outlast the day at capacity)")
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--fake", action="store_true", help="the fake engine (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "batch_tier.json"))
    args = p.parse_args(argv)
    args.gateway_flags = ["--max-num-seqs", str(args.max_num_seqs)] + (
        ["--fake", "--fake-step-ms", "20"] if args.fake else [])
    capacity = args.capacity
    if capacity is None:
        with Gateway(*args.gateway_flags) as gw:
            capacity = measure_capacity(gw.url, args)
    if args.batch_lines is None:
        args.batch_lines = max(16, int(capacity * args.day_seconds * 1.5))
    runs = [one_day(args, False, capacity), one_day(args, True, capacity)]
    result = {"capacity_requests_per_s": capacity, "day_seconds": args.day_seconds,
              "runs": runs, "ratios": ratios(*runs), "fake": args.fake}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\n### A compressed day ({args.day_seconds:g} s), online {capacity / 4:.2f} to "
          f"{capacity:.2f} req/s, with and without the batch tier\n")
    print(table(runs))
    print("\nratios (with / without):", json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
