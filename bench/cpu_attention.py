"""Decode attention on the CPU: `kernels/cpu_attention.py` against the reference it replaced
(`paged_decode_attention_ref`, torch's SDPA with a mask and grouped-query heads), side by side
in one process, on SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64,
16-slot pages scattered through the cache) for a grid of batch sizes and context lengths.

    python bench/cpu_attention.py             # batch 1, 16, 64 x context 128, 512, 2048
    python bench/cpu_attention.py --quick     # batch 1, 64 x context 512

Per shape: the best time of one layer's decode attention for each implementation (each
gets the same gathered pages; the reference also builds its slot matrix, once per step in
the runtime, outside the timing) and the speedup; x30 layers gives the share of a step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (also puts the repo root on sys.path)
from common import best_time, fmt, log, markdown_table  # noqa: E402

import torch  # noqa: E402

from kernels.cpu_attention import paged_decode_attention_cpu  # noqa: E402
from kernels.paged_attention import context_slots, paged_decode_attention_ref  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def case(batch: int, context: int, gen: torch.Generator):
    """Random caches, shuffled page tables and context lengths between half and all of
    `context`, as a running batch has."""
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq + 1
    k_cache = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    tables = (torch.randperm(num_pages - 1, generator=gen)[:batch * pages_per_seq] + 1)
    tables = tables.view(batch, pages_per_seq)
    lens = torch.randint(max(1, context // 2), context + 1, (batch,), generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return q, k_cache, v_cache, tables, lens


def measure(batch: int, context: int, gen: torch.Generator) -> dict:
    q, k_cache, v_cache, tables, lens = case(batch, context, gen)
    scale = HEAD_DIM ** -0.5
    slots, valid = context_slots(tables, lens, PAGE)
    ref = best_time(lambda: paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale),
                    reps=5, min_total_s=0.5)
    ours = best_time(lambda: paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens,
                                                        PAGE, scale), reps=5, min_total_s=0.5)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, PAGE, scale)
    err = float((got - expected).abs().max())
    return {"batch": batch, "context": context, "ref_ms": ref * 1e3, "ours_ms": ours * 1e3,
            "speedup": ref / ours, "max_abs_err": err}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    common.setup_threads(args.threads)
    info = common.machine_info()
    log(f"machine: {info}")
    batches, contexts = ([1, 64], [512]) if args.quick else ([1, 16, 64], [128, 512, 2048])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        for c in contexts:
            r = measure(b, c, gen)
            log(f"batch {b} context {c}: ref {r['ref_ms']:.2f} ms, ours {r['ours_ms']:.2f} ms")
            rows.append(r)
    print(markdown_table(
        ["batch", "context (max)", "reference ms/layer", "ours ms/layer", "speedup",
         "ours x30 layers ms", "max abs err"],
        [[r["batch"], r["context"], fmt(r["ref_ms"]), fmt(r["ours_ms"]),
          fmt(r["speedup"]) + "x", fmt(r["ours_ms"] * LAYERS, 1), f"{r['max_abs_err']:.1e}"]
         for r in rows]))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "results", "cpu_attention.json")
    common.write_json(out, {"machine": info, "results": rows})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
