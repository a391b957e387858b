"""Benchmarks of the load tester (not collected by pytest). Prints markdown tables and writes
JSON under bench/results/.

1. capacity: the tester's own limits against the fake-engine gateway, the tester pinned to one
   core and the gateway to the other: (a) 1,000 concurrent streams (closed loop), (b) 500 short
   requests per second (open loop); each with the tester's event-loop lag (target: p99 < 10 ms).
2. prefix cache: `shared-prefix` against the real model with the prefix cache on and off:
   TTFT, cache-hit rate and revenue per GPU-hour side by side.

    python -m bench.loadtest            # both, full size
    python -m bench.loadtest --quick    # short runs
    python -m bench.loadtest --skip-model
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import uvloop

from loadtest.dists import Dist
from loadtest.mix import Mix
from loadtest.pricing import PriceBook
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load
from loadtest.slo import SLO
from loadtest.workloads import WorkloadParams
from testkit.gateway_server import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "bench" / "results"


class Gateway:
    """A gateway subprocess, pinned to `cpus` when taskset exists."""

    def __init__(self, *flags: str, cpus: str | None = None, timeout: float = 600):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gateway", "--port", str(self.port), *flags]
        if cpus and shutil.which("taskset"):
            cmd = ["taskset", "-c", cpus, *cmd]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("gateway not ready")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)


def pin_self() -> str:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
        return str(cores[1]) if len(cores) == 2 else ",".join(map(str, cores[1:]))
    return str(cores[0])


def run(st: Settings) -> dict:
    return uvloop.run(run_load(st))[0]


def capacity(quick: bool, gateway_cpus: str) -> list[dict]:
    rows = []
    d = 5.0 if quick else 20.0
    cases = [
        ("1000 concurrent streams", ["--fake-step-ms", "50", "--max-num-seqs", "1100",
                                     "--max-queue", "4096"],
         LoadShape(concurrency=1000, duration=d, warmup=2.0, grace=60),
         WorkloadParams(input_len=Dist.parse(16), output_len=Dist.parse(40))),
        ("500 short requests/s", ["--fake-step-ms", "2", "--max-num-seqs", "256",
                                  "--max-queue", "4096"],
         LoadShape(rate=500, arrival="poisson", duration=d, warmup=1.0, grace=60),
         WorkloadParams(input_len=Dist.parse(16), output_len=Dist.parse(2))),
    ]
    for name, flags, shape, params in cases:
        with Gateway("--fake", *flags, cpus=gateway_cpus) as gw:
            st = Settings(gw.url, "random", shape, params, Mix.default(), seed=1)
            result = run(st)
        s, c = result["summary"], result["client"]
        (RESULTS / f"loadtest_capacity_{name.split()[0]}.json").write_text(json.dumps(result))
        rows.append({"case": name, "completed": s["requests"]["completed"],
                     "failed": s["requests"]["failed"], "errors": s["requests"]["errors"],
                     "req_s": s["throughput"]["requests_per_s"],
                     "tok_s": s["throughput"]["output_tokens_per_s"],
                     "max_in_flight": c["max_in_flight"],
                     "sched_lag_p99_ms": s["latency_ms"]["schedule_lag"]["p99"],
                     "lag_p50_ms": c["loop_lag_ms"]["p50"], "lag_p99_ms": c["loop_lag_ms"]["p99"],
                     "lag_max_ms": c["loop_lag_ms"]["max"],
                     "itl_p50_ms": s["latency_ms"]["itl"]["p50"]})
    return rows


def prefix_cache(quick: bool) -> list[dict]:
    rows = []
    n = 4 if quick else 8
    params = WorkloadParams(input_len=Dist.parse(8), output_len=Dist.parse(8),
                            prefix_len=300 if quick else 600)
    for label, flag in (("on", "--prefix-caching"), ("off", "--no-prefix-caching")):
        with Gateway("--kv-cache-gb", "0.25", flag) as gw:
            st = Settings(gw.url, "shared-prefix", LoadShape(concurrency=1, requests=n + 1,
                                                                warmup_requests=1),
                          params, Mix.default(), seed=3, slo=SLO(),
                          book=PriceBook.preset("deepseek-r1", use_reported=False), gpus=1,
                          gpu_cost_per_hour=2.0)
            result = run(st)
        (RESULTS / f"loadtest_prefix_cache_{label}.json").write_text(json.dumps(result))
        s = result["summary"]
        rows.append({"prefix cache": label, "requests": s["requests"]["completed"],
                     "ttft_p50_ms": s["latency_ms"]["ttft"]["p50"],
                     "ttft_p90_ms": s["latency_ms"]["ttft"]["p90"],
                     "itl_p50_ms": s["latency_ms"]["itl"]["p50"],
                     "hit_rate": s["cache"]["hit_rate"],
                     "req_s": s["throughput"]["requests_per_s"],
                     "revenue_per_gpu_hour": s["money"]["revenue_per_gpu_hour"],
                     "cost_source": s["money"]["sources"]})
    return rows


def table(rows: list[dict]) -> str:
    cols = list(rows[0])

    def cell(v) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--skip-model", action="store_true", help="only the capacity benchmark")
    p.add_argument("--skip-capacity", action="store_true", help="only the prefix-cache one")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.skip_capacity:
        gateway_cpus = pin_self()
        rows = capacity(args.quick, gateway_cpus)
        print("\n### Load tester capacity (tester on one core, fake-engine gateway on the "
              "other)\n")
        print(table(rows))
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if not args.skip_model:
        rows = prefix_cache(args.quick)
        print("\n### shared-prefix on SmolLM2-135M (CPU), prefix cache on vs off "
              "(deepseek-r1 prices, 1 GPU-equivalent)\n")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
