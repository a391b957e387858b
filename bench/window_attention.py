"""Sliding-window decode attention on the CPU (issue 31): Gemma 3 270M's local layers (4 query
heads, 1 KV head of 256, a 512-token window) at contexts past the window, three ways side by
side in one run: the C kernel taking the window (what serves now), the torch reference path
(what served a windowed layer past its window before: runtime/models/window_attention.py), and
the C kernel over the whole context (what ignoring the window would cost, and read).

    python -m bench.window_attention                 # batches 1 and 8, contexts 1k-8k
"""
from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch

from bench.common import REPO_ROOT, fmt, markdown_table, median, write_json
from kernels import cpu_ops
from runtime.models.window_attention import windowed_attention

PAGE = 16


def _case(batch: int, context: int, heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(context + batch)
    blocks = -(-context // PAGE)
    tables = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).long()
    k = torch.randn(batch * blocks * PAGE, 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch * blocks * PAGE, 1, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int64)
    return q, k, v, tables, lens


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def measure(batch: int, context: int, window: int, heads: int, head_dim: int,
            dtype: torch.dtype, repeats: int) -> dict:
    q, k, v, tables, lens = _case(batch, context, heads, head_dim, dtype)
    scale = head_dim ** -0.5
    meta = SimpleNamespace(decode_lens=lens, decode_tables=tables, block_size=PAGE,
                           chunk_starts=torch.zeros(1, dtype=torch.int64),
                           chunk_prefix=torch.zeros(0, dtype=torch.int64), num_chunks=0)
    out = torch.empty_like(q)
    kernel = _time(lambda: cpu_ops.decode_attention(q, k, v, tables, lens, PAGE, scale,
                                                    out=out, window=window), repeats)
    reference = _time(lambda: windowed_attention(q, k, v, meta, window, scale, out), repeats)
    whole = _time(lambda: cpu_ops.decode_attention(q, k, v, tables, lens, PAGE, scale,
                                                   out=out), repeats)
    return {"batch": batch, "context": context, "kernel_ms": kernel * 1e3,
            "reference_ms": reference * 1e3, "whole_context_ms": whole * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.window_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="1024,2048,8192")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=str(REPO_ROOT / "bench" / "results" /
                                         "window_attention.json"))
    a = p.parse_args(argv)
    if not cpu_ops.available():  # builds or loads the compiled ops
        p.error("no compiled CPU ops on this machine")
    load = os.getloadavg()[0]
    rows, runs = [], []
    for batch in (int(b) for b in a.batches.split(",")):
        for context in (int(c) for c in a.contexts.split(",")):
            r = measure(batch, context, a.window, 4, 256, torch.float16, a.repeats)
            runs.append(r)
            rows.append([batch, context, fmt(r["kernel_ms"], 3), fmt(r["reference_ms"], 3),
                         fmt(r["whole_context_ms"], 3),
                         fmt(r["reference_ms"] / r["kernel_ms"]) + "x",
                         fmt(r["whole_context_ms"] / r["kernel_ms"]) + "x"])
    print(markdown_table(["batch", "context", "C kernel, window (ms)", "torch window path (ms)",
                          "C kernel, whole context (ms)", "torch / kernel",
                          "whole / window"], rows))
    print(f"\nfloat16 cache, Gemma 3 270M's local-layer shape, window {a.window}; "
          f"{torch.get_num_threads()} threads; load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    write_json(a.json, {"window": a.window, "runs": runs, "load": load})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
