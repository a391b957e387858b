"""Gateway throughput with telemetry fully on against off, side by side in one run.

Two fake-engine gateways: one with request spans on and a live-feed subscriber connected to
/admin/telemetry for the whole run (every span and snapshot is built, serialised and sent),
one started with --no-telemetry. The same streams go through each, alternating, and the
table gives streamed tokens/s and the on/off ratio (target: at least 0.90).

    .venv/bin/python -m bench.telemetry [--concurrency 64,256] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading

from bench.common import REPO_ROOT, fmt, log, machine_info, markdown_table, write_json
from bench.gateway import ServerProcess, free_port, measure


def start_gateway(step_ms: float, seqs: int, telemetry: bool) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--fake", "--port", str(port), "--fake-step-ms",
            str(step_ms), "--max-num-seqs", str(seqs), "--max-queue", "4096",
            "--keepalive-seconds", "60"]
    if not telemetry:
        argv.append("--no-telemetry")
    return ServerProcess("telemetry-on" if telemetry else "telemetry-off", argv, port)


def subscribe_feed(url: str, stop: threading.Event, counter: dict) -> threading.Thread:
    """A live-feed consumer reading every frame, in its own thread and loop."""
    async def consume():
        import aiohttp
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url + "/admin/telemetry") as ws:
                while not stop.is_set():
                    try:
                        msg = await asyncio.wait_for(ws.receive(), 0.5)
                    except TimeoutError:
                        continue
                    counter["frames"] += 1
                    counter["bytes"] += len(msg.data or "")
    thread = threading.Thread(target=lambda: asyncio.run(consume()), daemon=True)
    thread.start()
    return thread


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/telemetry.json"))
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    on = start_gateway(args.step_ms, max(levels), True)
    off = start_gateway(args.step_ms, max(levels), False)
    stop, feed = threading.Event(), {"frames": 0, "bytes": 0}
    subscribe_feed(on.url, stop, feed)
    rows = []
    try:
        for s in (on, off):
            measure(s, 8, 4, prewarm=False)
        for c in levels:
            best = {"on": 0.0, "off": 0.0}
            for _ in range(args.rounds):
                for name, server in (("on", on), ("off", off)):
                    r = measure(server, c, args.tokens, prewarm=True)
                    best[name] = max(best[name], r["tokens_per_s"])
            log(f"{c} streams: on {best['on']:.0f} tok/s, off {best['off']:.0f} tok/s")
            rows.append({"concurrency": c, "on_tokens_per_s": best["on"],
                         "off_tokens_per_s": best["off"], "ratio": best["on"] / best["off"]})
    finally:
        stop.set()
        on.stop()
        off.stop()
    print(markdown_table(["streams", "telemetry on tok/s", "telemetry off tok/s", "on / off"],
                         [[r["concurrency"], fmt(r["on_tokens_per_s"], 0),
                           fmt(r["off_tokens_per_s"], 0), fmt(r["ratio"], 3)] for r in rows]))
    print(f"feed frames received during the run: {feed['frames']} ({feed['bytes']} bytes); "
          f"best of {args.rounds} alternating rounds per side")
    met = all(r["ratio"] >= 0.9 for r in rows)
    print(f"target (on/off >= 0.90): {'met' if met else 'NOT met'}")
    write_json(args.out, {"benchmark": "telemetry", "machine": machine_info(), "rows": rows,
                          "feed": feed, "tokens": args.tokens, "step_ms": args.step_ms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
