"""Cache-aware routing against rendezvous hashing, side by side on the same workload.

Two fake-engine workers in one process on virtual clocks (testkit/fleet_sim.py): the
real worker loop, worker handles and dispatcher, frames crossing as bytes; only the engines'
work is simulated. Each fake engine has a bounded LRU prefix cache keyed by the model engine's
own block hashes, and publishes the same KV events; its cost model charges a step
(--step-ms) plus a prefill time per prompt token its cache did not serve (--prefill-us).

Workload: multi-tenant conversations over shared system prompts (several tenants, each with a
few long system prompts, salts per tenant; each conversation sends several short user turns,
re-sending the whole history each turn, a think time after each reply). Scenarios:
  distinct    every system prompt has its own first tokens; tenants chosen 1/(i+1)
  hot tenant  a tenant's prompts share a preamble longer than the hash's key (64 tokens), and
              one tenant sends most of the traffic (weights 1/(i+1)^2): hashing pins a tenant
              to one worker
Modes: hash (the dispatcher before this change: rendezvous hash of the salt and the first 64
tokens, spilling to the least loaded past the busy margin) and cache-aware (the worker holding
the longest cached prefix within the margin, the hash when none holds any block).

Figures: hit rate = cached prompt tokens / prompt tokens (every turn's usage, as billed);
misses = prompt tokens the workers computed; TTFT = virtual seconds from a turn's arrival to
its first token, as the cost model implies (queueing at the gateway included).

    python -m bench.prefix_routing            # about 10-20 s
    python -m bench.prefix_routing --quick    # fewer conversations

Prints a table and writes bench/results/prefix_routing.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from bench.common import REPO_ROOT, fmt, log, machine_info, markdown_table, write_json
from contract.model_files import default_model_path
from runtime.loading.gguf import read_gguf_tokenizer
from testkit.fleet_sim import Workload, simulate

SCENARIOS = {
    "distinct": dict(tenants=4, prompts_per_tenant=3, system_tokens=800, preamble_tokens=0,
                     skew=1.0),
    "hot tenant": dict(tenants=4, prompts_per_tenant=3, system_tokens=800,
                       preamble_tokens=400, skew=2.0),
}
HEADERS = ["scenario", "routing", "requests", "hit rate", "misses (tokens)", "misses vs hash",
           "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "requests per worker",
           "evictions per worker"]


def run(args, tokenizer) -> list[dict]:
    engine = {"block_size": 16, "num_blocks": args.num_blocks, "max_num_seqs": 16,
              "step_seconds": args.step_ms / 1e3,
              "prefill_seconds_per_token": args.prefill_us / 1e6}
    rows = []
    for name, shape in SCENARIOS.items():
        workload = Workload(conversations=args.conversations, rate=args.rate, max_tokens=24,
                            vocab=tokenizer.vocab_size, seed=args.seed, **shape)
        hash_misses = 0
        for routing, aware in (("hash", False), ("cache-aware", True)):
            start = time.perf_counter()
            f = simulate(workload, tokenizer, prefix_routing=aware, engine_kwargs=engine)
            misses = f.prompt_tokens - f.cached_tokens
            if not aware:
                hash_misses = misses
            rows.append({"scenario": name, "routing": routing, "requests": f.requests,
                         "prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens,
                         "hit_rate": f.hit_rate, "misses": misses,
                         "misses_vs_hash": misses / max(1, hash_misses),
                         "ttft_mean_ms": f.ttft_mean_s * 1e3, "ttft_p50_ms": f.ttft_p50_s * 1e3,
                         "ttft_p99_ms": f.ttft_p99_s * 1e3, "per_worker": list(f.per_worker),
                         "evictions": list(f.evictions), "workload": dataclasses.asdict(workload),
                         "wall_s": time.perf_counter() - start})
            log(f"{name}, {routing}: {time.perf_counter() - start:.1f} s")
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(HEADERS, [
        [r["scenario"], r["routing"], r["requests"], fmt(r["hit_rate"], 3), r["misses"],
         fmt(r["misses_vs_hash"], 2), fmt(r["ttft_mean_ms"], 1), fmt(r["ttft_p50_ms"], 1),
         fmt(r["ttft_p99_ms"], 1), "/".join(map(str, r["per_worker"])),
         "/".join(map(str, r["evictions"]))] for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="80 conversations per scenario")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--rate", type=float, default=12.0, help="new conversations per second")
    ap.add_argument("--num-blocks", type=int, default=800, help="cache blocks (of 16) per worker")
    ap.add_argument("--step-ms", type=float, default=20.0, help="a fake engine step")
    ap.add_argument("--prefill-us", type=float, default=50.0,
                    help="prefill per uncached prompt token, in microseconds")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "prefix_routing.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations = 80
    tokenizer = read_gguf_tokenizer(default_model_path())
    rows = run(args, tokenizer)
    print(table(rows), flush=True)
    write_json(args.out, {"machine": machine_info(), "settings": vars(args), "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
