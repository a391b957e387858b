"""The gateway's streaming overhead: the gateway with its fake engine against a bare aiohttp
SSE server that streams the same chunks at the same cadence, side by side in one run.

    python -m bench.gateway                       # 64, 256 and 1,024 concurrent streams
    python -m bench.gateway --quick               # 64 and 256 streams, fewer tokens
    python -m bench.gateway --steady 10           # steady load instead of one burst

Both servers run in their own processes; the client (this process, uvloop + aiohttp) runs in a
third. The fake engine sleeps --step-ms per step and then emits one token to every running
request; the bare server has one asyncio task doing the same (snapshot the open streams, sleep
--step-ms, emit the next token to each as the same OpenAI completion chunk), so what differs is
only the gateway's machinery: queue, dispatch, worker process, frames, detokenization, SSE.

By default each level is one burst: every stream is sent at the same moment, the worst case
for time to first token (the last request of the burst waits for every one before it to be
parsed, authenticated, tokenized and queued). `--steady` measures what a serving system sees
in steady state: the same number of concurrent streams, started at random moments and each
replaced as it ends.

Per stream the client records time to first token (request sent on an already open connection
to the first content event), every inter-token gap, and the token count. Reported per system:
streamed tokens/s (all tokens / wall time of the whole batch), TTFT and inter-token-latency
p50/p99, the gateway's throughput as a ratio of the bare server's, the added latency (gateway
minus bare at the same percentile), and the CPU seconds of the client and of each server (on a
2-core machine the client itself can be the bottleneck at 1,024 streams: its CPU share shows it).
"""
from __future__ import annotations

import argparse
import os
import sys

# bench/telemetry.py imports ServerProcess, free_port and measure from here
from bench.gateway_client import measure
from bench.gateway_servers import REPO_ROOT, ServerProcess, free_port, serve_bare


# ---- main -------------------------------------------------------------------------------------
def _raise_fd_limit() -> None:
    """1,024 streams need more than a 1,024-descriptor soft limit; children inherit this."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="64,256,1024",
                   help="comma-separated concurrent stream counts")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step time (both systems)")
    p.add_argument("--quick", action="store_true", help="64 and 256 streams, 32 tokens")
    p.add_argument("--no-prewarm", action="store_true",
                   help="connect inside the timed window (TTFT then includes TCP connect)")
    p.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                   help="steady load instead of one burst: clients start at random over one "
                        "stream's length, then each runs stream after stream; TTFT and ITL "
                        "of the streams started in the next SECONDS")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/gateway.json"))
    p.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.serve_bare:
        serve_bare(args.serve_bare, args.step_ms)
        return 0

    from bench.common import fmt, log, machine_info, markdown_table, write_json

    _raise_fd_limit()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    tokens = args.tokens
    if args.quick:
        levels = [c for c in levels if c <= 256] or [64, 256]
        tokens = min(tokens, 32)
    seqs = max(levels)
    ramp = tokens * args.step_ms / 1000  # one stream's length: the load is steady after it
    steady = (ramp, args.steady) if args.steady > 0 else None
    py = sys.executable
    servers: dict[str, ServerProcess] = {}
    rows: list[dict] = []
    try:
        log("starting the bare server and the gateway (--fake) ...")
        port = free_port()
        servers["bare"] = ServerProcess(
            "bare", [py, "-m", "bench.gateway", "--serve-bare", str(port),
                     "--step-ms", str(args.step_ms)], port)
        port = free_port()
        servers["gateway"] = ServerProcess(
            "gateway", [py, "-m", "gateway", "--fake", "--port", str(port),
                        "--fake-step-ms", str(args.step_ms), "--max-num-seqs", str(seqs),
                        "--max-queue", str(max(1024, 2 * seqs)), "--keepalive-seconds", "60"],
            port)
        for s in servers.values():  # warm-up: imports, first-request paths, tokenizer
            measure(s, 8, 4, prewarm=False)
        for c in levels:
            for name in ("bare", "gateway"):
                log(f"{name}: {c} streams x {tokens} tokens ...")
                r = measure(servers[name], c, tokens, prewarm=not args.no_prewarm,
                            steady=steady)
                log(f"  {r['tokens_per_s']:.0f} tok/s, TTFT p99 {r['ttft_p99_ms']:.1f} ms, "
                    f"client CPU {100 * r['client_cpu_share']:.0f}%, "
                    f"server CPU {100 * r['server_cpu_share']:.0f}%, errors {r['errors']}")
                rows.append(r)
    finally:
        for s in servers.values():
            s.stop()

    comparisons = []
    for c in levels:
        bare = next(r for r in rows if r["concurrency"] == c and r["system"] == "bare")
        gw = next(r for r in rows if r["concurrency"] == c and r["system"] == "gateway")
        comparisons.append({
            "concurrency": c,
            "throughput_ratio": gw["tokens_per_s"] / bare["tokens_per_s"],
            "added_ttft_p50_ms": gw["ttft_p50_ms"] - bare["ttft_p50_ms"],
            "added_ttft_p99_ms": gw["ttft_p99_ms"] - bare["ttft_p99_ms"],
            "added_itl_p50_ms": gw["itl_p50_ms"] - bare["itl_p50_ms"],
            "added_itl_p99_ms": gw["itl_p99_ms"] - bare["itl_p99_ms"],
            "same_text": bare["distinct_texts"] == gw["distinct_texts"],
            "gateway_queue_p99_ms": gw["gateway_queue_p99_ms"],
        })

    table = []
    for r in rows:
        cmp = next(x for x in comparisons if x["concurrency"] == r["concurrency"])
        gw = r["system"] == "gateway"
        table.append([r["concurrency"], r["system"], fmt(r["tokens_per_s"], 0),
                      fmt(r["ttft_p50_ms"], 1), fmt(r["ttft_p99_ms"], 1),
                      fmt(r["itl_p50_ms"], 1), fmt(r["itl_p99_ms"], 1),
                      fmt(cmp["throughput_ratio"], 2) if gw else "1.00",
                      fmt(cmp["added_ttft_p99_ms"], 1) if gw else "-",
                      f"{100 * r['client_cpu_share']:.0f}%", f"{100 * r['server_cpu_share']:.0f}%",
                      r["errors"]])
    headers = ["streams", "system", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms", "vs bare", "added TTFT p99 ms", "client CPU", "server CPU",
               "errors"]
    print(markdown_table(headers, table))
    print()
    for cmp in comparisons:
        print(f"{cmp['concurrency']} streams: throughput ratio {cmp['throughput_ratio']:.2f}, "
              f"added TTFT p50/p99 {cmp['added_ttft_p50_ms']:.1f}/{cmp['added_ttft_p99_ms']:.1f}"
              f" ms, added ITL p50/p99 {cmp['added_itl_p50_ms']:.1f}/"
              f"{cmp['added_itl_p99_ms']:.1f} ms, gateway x-queue-seconds p99 "
              f"{fmt(cmp['gateway_queue_p99_ms'], 1)} ms, same text: {cmp['same_text']}")
    t256 = next((x for x in comparisons if x["concurrency"] == 256), None)
    if t256:
        ok = t256["throughput_ratio"] >= 0.5 and t256["added_ttft_p99_ms"] < 10.0
        print(f"target at 256 streams (>= 0.5x bare throughput, added TTFT p99 < 10 ms): "
              f"{'met' if ok else 'NOT met'}")
    print("client/server CPU: CPU seconds / wall seconds of the load (100% = one core); "
          f"this machine has {os.cpu_count()} cores shared by client, servers and others.")

    out = write_json(args.out, {
        "benchmark": "gateway", "step_ms": args.step_ms, "tokens_per_stream": tokens,
        "concurrency": levels, "prewarmed_connections": not args.no_prewarm,
        "mode": f"steady {args.steady:g} s after a {ramp:g} s ramp" if steady else "burst",
        "gateway_max_num_seqs": seqs, "machine": machine_info(),
        "results": rows, "comparisons": comparisons})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
