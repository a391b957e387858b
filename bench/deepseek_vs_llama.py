"""A DeepSeek-V2-Lite-shaped model, ours against llama.cpp's server on the same `deepseek2`
GGUF (issue 32): streamed output tokens/s at 1, 8 and 32 streams (targets: at least 1.0x at 1,
1.5x at 8 and 32), load time and resident memory; then the experts' share of our decode step.

The file: V2-Lite's widths with `--layers` decoder layers (one dense, the rest MoE), random
weights in Q4_0, written once under ~/.cache/inferstack/bench by bench/synthetic_deepseek.py.
The servers run as bench/files_vs_llama.py runs them (each alone, started fresh per round, the
order alternating over `--rounds`, closed-loop clients streaming 128-token chat answers with
EOS ignored, the same KV room: llama.cpp `-np S -c S*512`, ours `--kv-cache-gb` of S x 512
tokens of its latent cache in float16). The expert share is measured in this process
afterwards (bench/expert_share.py) at `--share-batches` sequences.

    python -m bench.deepseek_vs_llama                          # 4 layers, 2 rounds
    python -m bench.deepseek_vs_llama --layers 6 --rounds 3 --streams 1,8,32
    python -m bench.deepseek_vs_llama --preset tiny --rounds 1 --streams 1,2   # smoke run
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

from bench import expert_share
from bench.common import (
    REPO_ROOT,
    fmt,
    log,
    machine_info,
    markdown_table,
    median,
    read_bandwidth_gbs,
    setup_threads,
    write_json,
)
from bench.files_vs_llama import CONTEXT, ServerResult, kv_bytes, run_file
from bench.synthetic_deepseek import PRESETS, ensure

CACHE = Path.home() / ".cache" / "inferstack" / "bench"
TARGETS = {1: 1.0}  # ours / llama.cpp at each stream count; 1.5x at every other


def synthetic_path(preset: str, layers: int, kind: str) -> Path:
    return CACHE / f"deepseek-{preset}-{layers}l-{kind.lower()}.gguf"


def target(streams: int) -> float:
    return TARGETS.get(streams, 1.5)


def table(path: str, results: dict[str, ServerResult], streams: list[int]) -> str:
    """files_vs_llama's table with the issue's targets beside the stream rows."""
    ours, peer = results["ours"], results["llama.cpp"]
    rows = []
    for n in streams:
        ratio = median(ours.tok_s[n]) / median(peer.tok_s[n])
        verdict = "met" if ratio >= target(n) else "missed"
        rows.append([f"{n} stream{'s' if n > 1 else ''}, tok/s", fmt(median(peer.tok_s[n])),
                     fmt(median(ours.tok_s[n])), fmt(ratio) + "x",
                     f"{target(n):.1f}x: {verdict}"])
    rows.append(["load, s", fmt(median(peer.load_s)), fmt(median(ours.load_s)),
                 fmt(median(ours.load_s) / median(peer.load_s)) + "x", ""])
    rows.append(["resident, MiB", f"{median(peer.rss_mib):.0f}", f"{median(ours.rss_mib):.0f}",
                 fmt(median(ours.rss_mib) / median(peer.rss_mib)) + "x", ""])
    size = Path(path).stat().st_size / 2 ** 20
    rounds = len(ours.load_s)
    return f"{Path(path).name} ({size:.0f} MiB file)\n\n" + markdown_table(
        [f"measure (median of {rounds})", "llama.cpp", "ours", "ours / llama.cpp", "target"],
        rows)


def rounds_text(results: dict[str, ServerResult], streams: list[int]) -> str:
    """Each round's figure, as docs/perf.md gives them under a table."""
    parts = []
    for name, res in results.items():
        per = ", ".join("/".join(f"{v:.1f}" for v in res.tok_s[n]) for n in streams)
        parts.append(f"{name} {per}")
    return "Rounds (tok/s at " + ", ".join(map(str, streams)) + " streams): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.deepseek_vs_llama", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4,
                   help="decoder layers of the file: 1 dense + N-1 MoE (default 4)")
    p.add_argument("--preset", default="v2-lite", choices=sorted(PRESETS),
                   help="the file's widths: v2-lite (the comparison), tiny (a smoke run)")
    p.add_argument("--streams", default="1,8,32", help="concurrencies (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--share-batches", default="1,8",
                   help="sequences at which the expert share is measured ('' to skip)")
    p.add_argument("--share-steps", type=int, default=16, help="decode steps timed per batch")
    p.add_argument("--json",
                   default=str(REPO_ROOT / "bench" / "results" / "deepseek_vs_llama.json"))
    a = p.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",") if s.strip()]
    batches = [int(b) for b in a.share_batches.split(",") if b.strip()]
    path = str(ensure(synthetic_path(a.preset, a.layers, "Q4_0"), a.preset, a.layers, "Q4_0"))
    out: dict = {"cpu": machine_info()["cpu"], "load_before": os.getloadavg()[0], "path": path,
                 "layers": a.layers, "streams": streams}
    results = run_file("deepseek", path, streams, a.rounds, a.requests_per_stream) \
        if streams and a.rounds > 0 else None
    out["load_after_servers"] = os.getloadavg()[0]
    share = []
    if batches:
        log(f"expert share at {batches} sequences, {a.share_steps} decode steps each")
        setup_threads()  # every core, as the gateway's worker uses them
        share = expert_share.measure(path, batches, a.share_steps,
                                     kv_bytes(path, max(batches) * CONTEXT))
        out["read_gb_s"] = read_bandwidth_gbs()  # what the routed experts' GB/s is against
    out["load_after"] = os.getloadavg()[0]
    if results is not None:
        print(table(path, results, streams))
        print("\n" + rounds_text(results, streams))
        out.update({k: asdict(v) for k, v in results.items()})
    if share:
        print("\nExperts' share of our decode step (in process):\n")
        print(expert_share.table(share))
        print(f"\nthis machine reads {out['read_gb_s']:.1f} GB/s (bench/common.py "
              "read_bandwidth_gbs, all threads)")
        out["expert_share"] = [{**r.summary(), **asdict(r)} for r in share]
    print(f"\nmachine: {out['cpu']}, {os.cpu_count()} cores; load average "
          f"{out['load_before']:.1f} before, {out['load_after']:.1f} after")
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
