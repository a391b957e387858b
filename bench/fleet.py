"""A fleet of gateways: one gateway process against two (`--gateways 2`, one port shared with
SO_REUSEPORT), both over the same shared fake-engine workers and the same PostgreSQL and Redis,
at steady load, side by side in one run.

    python -m bench.fleet                                    # 256 and 1,024 steady streams
    python -m bench.fleet --concurrency 32 --steady 3        # a quick check

The bench starts PostgreSQL and Redis on loopback (testkit/services), `--workers` shared workers
(`python -m runtime serve --fake`), then each system in turn: `python -m gateway --workers 0
--worker-url ...` alone, and the same with `--gateways 2`. So what differs is only the number
of gateway processes: the engine, the stores and the client are the same. The client is
bench/gateway_client.py's steady load: each of the N clients starts at a random moment of one
stream's length, then runs stream after stream on a keep-alive connection; TTFT and ITL of the
streams started in the next --steady seconds count. Reported per system and level: streamed
tokens/s, TTFT and ITL p50/p99, and for two gateways its throughput ratio and added TTFT
(two minus one at the same percentile; negative: the fleet is faster).
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from bench.gateway import _raise_fd_limit
from bench.gateway_client import measure
from bench.gateway_servers import REPO_ROOT, ServerProcess, free_port

SYSTEMS = {"1 gateway": 1, "2 gateways": 2}


def wait_for_gateways(url: str, count: int, timeout: float = 120.0) -> None:
    """Until `count` distinct gateway processes have answered /ready on fresh connections
    (a fleet child joins the port once it can serve; the first may be alone for a while)."""
    if count == 1:
        return
    pids: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(pids) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only gateways {sorted(pids)} answered")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                pids.add(r.headers["x-gateway-instance"])
        except OSError:
            time.sleep(0.1)


def start_workers(stack: ExitStack, count: int, step_ms: float, seqs: int) -> list[str]:
    """`count` shared fake-engine workers; their tcp:// URLs once each accepts."""
    urls = []
    for _ in range(count):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(port),
                                 "--fake", "--fake-step-ms", str(step_ms), "--max-num-seqs",
                                 str(seqs)], cwd=REPO_ROOT, stderr=subprocess.DEVNULL)
        stack.callback(_stop, proc)
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker on port {port} did not start") from None
                time.sleep(0.1)
        urls.append(f"tcp://127.0.0.1:{port}")
    return urls


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait()


def start_system(name: str, gateways: int, urls: list[str], stores, seqs: int,
                 folder: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--port", str(port), "--gateways", str(gateways),
            "--workers", "0", "--fake", "--max-queue", str(max(1024, 2 * seqs)),
            "--keepalive-seconds", "60", "--state-url", stores[0], "--redis-url", stores[1],
            "--ledger-path", f"{folder}/{gateways}.sqlite3"]
    for url in urls:
        argv += ["--worker-url", url]
    server = ServerProcess(name, argv, port)
    wait_for_gateways(server.url, gateways)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="256,1024", help="comma-separated stream counts")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="fake engine step time")
    p.add_argument("--steady", type=float, default=10.0, metavar="SECONDS",
                   help="measured window after a ramp of one stream's length")
    p.add_argument("--workers", type=int, default=1, help="shared fake-engine workers")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/fleet.json"))
    args = p.parse_args(argv)

    from bench.common import fmt, log, machine_info, markdown_table, write_json
    from testkit.services.postgres import postgres_server
    from testkit.services.redis import redis_server

    _raise_fd_limit()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    seqs = max(levels)
    steady = (args.tokens * args.step_ms / 1000, args.steady)
    rows: list[dict] = []
    with ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        log("starting PostgreSQL, Redis and the shared workers ...")
        pg = stack.enter_context(postgres_server())
        rd = stack.enter_context(redis_server(Path(folder)))
        urls = start_workers(stack, args.workers, args.step_ms, seqs)
        for name, gateways in SYSTEMS.items():
            log(f"{name}: starting ...")
            server = start_system(name, gateways, urls, (pg.url, rd.url), seqs, folder)
            try:
                measure(server, 8, 4, prewarm=False)  # warm-up: imports, first paths
                for c in levels:
                    log(f"{name}: {c} steady streams x {args.tokens} tokens ...")
                    r = measure(server, c, args.tokens, prewarm=True, steady=steady)
                    log(f"  {r['tokens_per_s']:.0f} tok/s, TTFT p99 {r['ttft_p99_ms']:.1f} "
                        f"ms, errors {r['errors']}")
                    rows.append({**r, "gateways": gateways})
            finally:
                server.stop()

    comparisons = []
    for c in levels:
        one, two = (next(r for r in rows if r["concurrency"] == c and r["system"] == s)
                    for s in SYSTEMS)
        comparisons.append({
            "concurrency": c, "throughput_ratio": two["tokens_per_s"] / one["tokens_per_s"],
            "added_ttft_p50_ms": two["ttft_p50_ms"] - one["ttft_p50_ms"],
            "added_ttft_p99_ms": two["ttft_p99_ms"] - one["ttft_p99_ms"]})
    table = []
    for r in rows:
        cmp = next(x for x in comparisons if x["concurrency"] == r["concurrency"])
        two = r["gateways"] == 2
        table.append([r["concurrency"], r["system"], fmt(r["tokens_per_s"], 0),
                      fmt(r["ttft_p50_ms"], 1), fmt(r["ttft_p99_ms"], 1),
                      fmt(r["itl_p50_ms"], 1), fmt(r["itl_p99_ms"], 1),
                      fmt(cmp["throughput_ratio"], 2) if two else "1.00",
                      fmt(cmp["added_ttft_p50_ms"], 1) if two else "-",
                      fmt(cmp["added_ttft_p99_ms"], 1) if two else "-",
                      f"{100 * r['server_cpu_share']:.0f}%", r["errors"]])
    print(markdown_table(["streams", "system", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                          "ITL p50 ms", "ITL p99 ms", "vs 1 gateway", "added TTFT p50 ms",
                          "added TTFT p99 ms", "gateway CPU", "errors"], table))
    print("gateway CPU: CPU seconds of the gateway process tree (supervisor and children, "
          "not the workers) / wall seconds (100% = one core)")
    out = write_json(args.out, {
        "benchmark": "fleet", "step_ms": args.step_ms, "tokens_per_stream": args.tokens,
        "concurrency": levels, "mode": f"steady {args.steady:g} s after a {steady[0]:g} s ramp",
        "shared_workers": args.workers, "worker_max_num_seqs": seqs, "machine": machine_info(),
        "results": rows, "comparisons": comparisons})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
