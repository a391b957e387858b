"""The Triton kernels on a CUDA GPU: paged decode attention's achieved bandwidth against the
device's measured copy bandwidth, and every kernel against its torch reference.

Decode sweep: batch 64..256 x context 1k..8k (every sequence at the full context, pages
shuffled through the cache, as a long-running server leaves them), bfloat16, Llama-3-8B attention
shape by default (32 query heads, 8 KV heads, head dim 128; change with --heads/--kv-heads/
--head-dim). Each case is the runtime's own call: `kernels.paged_decode_attention` with int64
block tables padded to the runtime's bucketed width, the context lengths and an output buffer.
Achieved bandwidth counts the bytes the op must move (K and V of every context token, q and
out); the copy bandwidth is a device-to-device `copy_` counted as bytes read plus bytes
written. Target: decode at >= 70% of copy bandwidth at batch 64 x 8k.

Each timing is the median of triton.testing.do_bench (L2 flushed between runs). Every case is
checked against its reference first (a few sequences of it, so the reference fits in memory).

    python -m bench.kernels            # full run (a few minutes on an H200)
    python -m bench.kernels --quick    # a corner of the sweep
    python -m bench.kernels --smoke    # tiny shapes on the CPU (Triton's interpreter): checks
                                       # the script itself, measures nothing
Writes bench/results/kernels.json and prints markdown tables.

    python -m bench.kernels --cpu-blocks   # no GPU: the CPU block kernels (kernels/cpu/
                                           # block_ops.c) on a GGUF's own Q4_1, Q4_K and Q6_K
                                           # blocks against torch's float GEMM on the float
                                           # copy they replace, per shape and step size
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from functools import partial

import torch

from bench.common import REPO_ROOT, fmt, log, markdown_table, write_json

BLOCK = 16
DEVICE = "cuda"


def need_cuda() -> None:
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (the kernels' CPU check is "
              "`pytest tests/kernels`, under Triton's interpreter).", file=sys.stderr)
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/kernels.py needs triton: pip install -e '.[dev]'", file=sys.stderr)
        sys.exit(2)


def bench_ms(fn) -> float:
    if DEVICE != "cuda":  # --smoke: one untimed-quality run
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: (bytes read + bytes written) per second, in GB/s."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def paged_case(batch, context, heads, kv_heads, head_dim, dtype, gen):
    """q, caches and shuffled block tables for `batch` sequences of `context` tokens, as the
    runtime packs them: int64, rows padded to its bucketed width
    (runtime/execution/step_inputs.py)."""
    from runtime.execution.step_inputs import table_width
    pages = -(-context // BLOCK)
    num_blocks = batch * pages + 1
    slots = num_blocks * BLOCK
    k_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks - 1, generator=gen).add_(1).to(DEVICE)
    tables = torch.zeros(batch, table_width(pages), dtype=torch.int64, device=DEVICE)
    tables[:, :pages] = perm[:batch * pages].view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int64, device=DEVICE)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=DEVICE)
    return q, k_cache, v_cache, tables, lens


def check_decode(q, k_cache, v_cache, tables, lens, scale, rows=4) -> float:
    """Max abs difference to the reference on the first `rows` sequences."""
    from kernels.paged_attention import context_slots, paged_decode_attention_ref
    q, tables, lens = q[:rows], tables[:rows], lens[:rows]
    got = runtime_decode(q, k_cache, v_cache, tables, lens, scale, None)
    slots, valid = context_slots(tables.long(), lens.long(), BLOCK)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, slots, valid, scale)
    return float((got.float() - ref.float()).abs().max())


def runtime_decode(q, k_cache, v_cache, tables, lens, scale, out):
    """Decode attention exactly as runtime/models/attention.py calls it."""
    import kernels
    return kernels.paged_decode_attention(q, k_cache, v_cache, None, None, scale,
                                          block_tables=tables, context_lens=lens,
                                          block_size=BLOCK, out=out)


def launch_us(fn, calls: int = 200) -> float:
    """Host time of one launch (checks, grid, enqueue): what a step pays per op before any
    device work, the part a CUDA graph removes."""
    calls = calls if DEVICE == "cuda" else 1  # --smoke: the interpreter is slow
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return 1e6 * host


def decode_sweep(args, copy_gbs: float) -> list[dict]:
    from kernels.paged_attention import pick_num_splits
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    elt = torch.finfo(dtype).bits // 8
    scale = args.head_dim ** -0.5
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            case = paged_case(batch, context, args.heads, args.kv_heads, args.head_dim, dtype,
                              gen)
            q, k_cache, v_cache, tables, lens = case
            err = check_decode(*case, scale)
            out = torch.empty_like(q)
            ms = bench_ms(partial(runtime_decode, q, k_cache, v_cache, tables, lens, scale, out))
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elt
            io_bytes = 2 * q.numel() * elt + tables.numel() * 4
            gbs = (kv_bytes + io_bytes) / (ms * 1e-3) / 1e9
            splits = pick_num_splits(batch, args.kv_heads, tables.shape[1] * BLOCK,
                                     args.head_dim, q.device)
            rows.append({"batch": batch, "context": context, "splits": splits, "ms": ms,
                         "gb_per_s": gbs, "fraction_of_copy": gbs / copy_gbs,
                         "max_abs_err": err})
            log(f"decode B={batch} ctx={context}: {ms:.3f} ms, {gbs:.0f} GB/s "
                f"({100 * gbs / copy_gbs:.0f}% of copy), err {err:.2e}")
            case = q = k_cache = v_cache = tables = lens = out = None  # free before the next
            torch.cuda.empty_cache()
    return rows


def decode_tuning(args, copy_gbs: float) -> list[dict]:
    """Launch settings around the defaults at the sweep's corners: what to change if the
    default misses the target somewhere."""
    from kernels.paged_attention import paged_decode_attention_triton
    gen = torch.Generator().manual_seed(2)
    scale = args.head_dim ** -0.5
    rows = []
    for batch, context in args.tune_cases:
        q, k_cache, v_cache, tables, lens = paged_case(batch, context, args.heads, args.kv_heads,
                                                       args.head_dim, torch.bfloat16, gen)
        nbytes = 2 * batch * context * args.kv_heads * args.head_dim * 2
        out = torch.empty_like(q)
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    ms = bench_ms(partial(
                        paged_decode_attention_triton, q, k_cache, v_cache, tables, lens, BLOCK,
                        scale, out=out, block_n=block_n, num_warps=num_warps,
                        num_stages=num_stages))
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    rows.append({"batch": batch, "context": context, "block_n": block_n,
                                 "num_warps": num_warps, "num_stages": num_stages, "ms": ms,
                                 "fraction_of_copy": gbs / copy_gbs})
        q = k_cache = v_cache = tables = lens = out = None
        torch.cuda.empty_cache()
    return rows


def kernel_vs_reference(args) -> list[dict]:
    """Every op at a serving-sized shape: Triton against its torch reference."""
    import kernels  # the dispatching functions: what the runtime calls
    # modules by path: kernels.rms_norm etc. are also the dispatching functions' names
    act, pa, pf, rn, ro, sk = (importlib.import_module(f"kernels.{m}") for m in (
        "activation", "paged_attention", "prefill_attention", "rms_norm", "rotary", "store_kv"))
    gen = torch.Generator().manual_seed(1)
    dt, dev = torch.bfloat16, DEVICE
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    hidden, inter, tokens = h * d, args.intermediate, args.tokens
    elt = 2
    x = torch.randn(tokens, hidden, dtype=dt, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dt, device=dev)
    qk = torch.randn(tokens, h + kvh, d, dtype=dt, device=dev)
    cos, sin = ro.rotary_cos_sin(torch.arange(tokens, device=dev), d, 500000.0, dt)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dt, device=dev)
    key = torch.randn(tokens, kvh, d, dtype=dt, device=dev)
    value = torch.randn_like(key)
    k_cache = torch.zeros(tokens * 4, kvh, d, dtype=dt, device=dev)
    v_cache = torch.zeros_like(k_cache)
    slot_map = torch.randperm(tokens * 4, generator=gen)[:tokens].to(dev)
    dbatch, dctx = args.decode_case
    decode = paged_case(dbatch, dctx, h, kvh, d, dt, gen)
    dq, dk, dv, dtab, dlens = decode
    dslots, dvalid = pa.context_slots(dtab.long(), dlens.long(), BLOCK)
    # prefill: 4 sequences of 512 new tokens after a 512-token cached prefix
    nseq, npre, nnew = args.prefill_case
    pq, pk, pv, ptab, _ = paged_case(nseq, npre + nnew, h, kvh, d, dt, gen)
    pq = torch.randn(nseq * nnew, h, d, dtype=dt, device=dev)
    cu = torch.arange(0, nseq * nnew + 1, nnew, dtype=torch.int32, device=dev)
    prefix = torch.full((nseq,), npre, dtype=torch.int32, device=dev)
    scale = d ** -0.5
    decode_bytes = 2 * dbatch * dctx * kvh * d * elt
    cases = [
        ("rms_norm + residual", lambda: rn.rms_norm_triton(x, w, 1e-5, res),
         lambda: rn.rms_norm_ref(x, w, 1e-5, res), 4 * x.numel() * elt),
        ("rotary (in place)", lambda: ro.apply_rotary_triton(qk, cos, sin),
         lambda: ro.apply_rotary_ref(qk, cos, sin), 2 * qk.numel() * elt),
        ("silu_and_mul", lambda: act.silu_and_mul_triton(gate_up),
         lambda: act.silu_and_mul_ref(gate_up), 1.5 * gate_up.numel() * elt),
        ("store_kv", lambda: sk.store_kv_triton(key, value, k_cache, v_cache, slot_map),
         lambda: sk.store_kv_ref(key, value, k_cache, v_cache, slot_map),
         4 * key.numel() * elt),
        (f"decode attention B={dbatch} ctx={dctx} (the runtime's call)",
         lambda: runtime_decode(dq, dk, dv, dtab, dlens, scale, None),
         lambda: pa.paged_decode_attention_ref(dq, dk, dv, dslots, dvalid, scale),
         decode_bytes),
        ("decode attention, [B, L] slots form (the runtime's call before block tables)",
         lambda: pa.paged_decode_attention_slots_triton(dq, dk, dv, dslots, dvalid, scale),
         lambda: pa.paged_decode_attention_ref(dq, dk, dv, dslots, dvalid, scale),
         decode_bytes),
        (f"prefill {nseq}x{nnew} new after {npre} cached",
         lambda: kernels.prefill_attention_varlen(pq, pk, pv, ptab, BLOCK, cu, prefix, scale,
                                                  nnew),
         lambda: pf.prefill_attention_varlen_ref(pq, pk, pv, ptab, BLOCK, cu, prefix, scale),
         None),
    ]
    rows = []
    for name, tri, ref, nbytes in cases:
        t_ms, r_ms = bench_ms(tri), bench_ms(ref)
        row = {"op": name, "triton_us": 1e3 * t_ms, "reference_us": 1e3 * r_ms,
               "speedup": r_ms / t_ms, "host_us_per_launch": launch_us(tri),
               "triton_gb_per_s": nbytes / (t_ms * 1e-3) / 1e9 if nbytes else None}
        if name.startswith("prefill"):
            ctx = npre + nnew
            flops = 4 * nseq * h * d * (nnew * npre + nnew * (nnew + 1) / 2)
            row["triton_tflops"] = flops / (t_ms * 1e-3) / 1e12
            row["prefix_context"] = ctx
        rows.append(row)
        log(f"{name}: triton {1e3 * t_ms:.1f} us, reference {1e3 * r_ms:.1f} us")
    return rows


# (N, K) of a small model's projections (SmolLM2-135M: 576 hidden, 1536 intermediate, 49152
# vocabulary; K = 576 is no multiple of 256, so no K-quant there), a Qwen3-0.6B-like pair
# that is, and a 3B Llama's MLP
CPU_BLOCK_SHAPES = [(576, 1536), (1536, 576), (49152, 576), (1024, 3072), (3072, 1024),
                    (3072, 8192), (8192, 3072)]
CPU_BLOCK_TOKENS = [1, 4, 16, 64, 256, 512]


def _random_blocks(fmt: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k/256, bytes] K-quant super-blocks: random bytes, float16 fields finite (any such
    bytes are a valid block; the timing depends on the layout, not the values)."""
    from kernels import cpu_ops
    size = cpu_ops.KQUANT_BYTES[fmt]
    raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=gen)
    halves = (torch.randn(n, k // 256, 2, generator=gen) * 0.01).half().view(torch.uint8)
    if fmt == cpu_ops.BLOCK_Q6_K:
        raw[..., 208:210] = halves[..., :2]  # d, the block's last field
    else:
        raw[..., :4] = halves  # d, dmin, its first
    return raw


def cpu_block_sweep(shapes, tokens, budget_s: float = 0.3) -> list[dict]:
    """Per shape, format and step size: the block kernel (row groups up to its small-step
    limit, panels above) against F.linear on the float32 weights, each the best of calls
    interleaved for `budget_s` (the machine may be shared: the least disturbed call)."""
    import torch.nn.functional as F

    from kernels import cpu_ops
    from runtime.loading.quantization import Int4Weight
    from testkit.q4_weights import q4_1_weight
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable: nothing to time")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in shapes:
        forms = [("Q4_1", cpu_ops.BLOCK_Q4)]
        if k % 256 == 0:
            forms += [("Q4_K", cpu_ops.BLOCK_Q4_K), ("Q6_K", cpu_ops.BLOCK_Q6_K)]
        for name, code in forms:
            if code == cpu_ops.BLOCK_Q4:
                p = Int4Weight(q4_1_weight(n, k))
                qs, d, m = p.qs, p.d, p.m
            else:
                qs, d, m = _random_blocks(code, n, k, gen), None, None
            dense = cpu_ops.block_dequantize(qs, code, d, m)
            for t in tokens:
                x = torch.randn(t, k, generator=gen)
                ours, theirs = [], []
                cpu_ops.block_linear(x, qs, code, d, m)
                F.linear(x, dense)
                end = time.perf_counter() + budget_s
                while time.perf_counter() < end or len(ours) < 3:
                    t0 = time.perf_counter()
                    cpu_ops.block_linear(x, qs, code, d, m)
                    t1 = time.perf_counter()
                    F.linear(x, dense)
                    ours.append(t1 - t0)
                    theirs.append(time.perf_counter() - t1)
                rows.append({"n": n, "k": k, "format": name, "tokens": t,
                             "block_ms": 1e3 * min(ours), "float_ms": 1e3 * min(theirs)})
                log(f"{n}x{k} {name} T={t}: {rows[-1]['block_ms']:.3f} ms, float "
                    f"{rows[-1]['float_ms']:.3f} ms")
    return rows


def cpu_blocks_main(args) -> None:
    threads = torch.get_num_threads() if args.threads is None else args.threads
    torch.set_num_threads(threads)
    rows = cpu_block_sweep(CPU_BLOCK_SHAPES, CPU_BLOCK_TOKENS)
    print(f"\n## CPU block kernels against F.linear on the float copy ({threads} threads)\n")
    print("Each cell: block kernel ms / float ms (ratio; below 1 the blocks are faster).\n")
    keys = sorted({(r["n"], r["k"], r["format"]) for r in rows},
                  key=lambda key: (CPU_BLOCK_SHAPES.index(key[:2]), key[2]))
    cell = {(r["n"], r["k"], r["format"], r["tokens"]): r for r in rows}
    print(markdown_table(
        ["N x K", "format"] + [f"T={t}" for t in CPU_BLOCK_TOKENS],
        [[f"{n}x{k}", name] + [
            f"{fmt(c['block_ms'], 3)} / {fmt(c['float_ms'], 3)} "
            f"({c['block_ms'] / c['float_ms']:.2f}x)"
            for c in (cell[(n, k, name, t)] for t in CPU_BLOCK_TOKENS)]
         for n, k, name in keys]))
    path = write_json(args.out.replace("kernels.json", "cpu_blocks.json"),
                      {"threads": threads, "rows": rows, "torch": torch.__version__})
    log(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 64, contexts 1k and 8k")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the elementwise ops")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "kernels.json"))
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-blocks", action="store_true",
                    help="time the CPU block kernels against torch's float GEMM (no GPU)")
    ap.add_argument("--threads", type=int, default=None, help="with --cpu-blocks")
    args = ap.parse_args()
    if args.cpu_blocks:
        cpu_blocks_main(args)
        return
    global DEVICE
    if args.smoke:
        import kernels
        kernels.FORCE_TRITON = kernels.HAS_TRITON  # the runtime's calls interpreted, as on CUDA
        DEVICE = "cpu"
        args.heads, args.kv_heads, args.head_dim, args.intermediate, args.tokens = 4, 2, 64, 64, 8
        args.batches, args.contexts = [2], [40]
        args.decode_case, args.prefill_case = (2, 40), (2, 16, 8)
        args.tune_cases = []
        args.out = os.path.join(tempfile.gettempdir(), "kernels-smoke.json")
        name = "cpu (smoke: Triton interpreter, timings meaningless)"
        copy_gbs = 1.0
    else:
        need_cuda()
        args.batches = [64] if args.quick else [64, 128, 256]
        args.contexts = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192]
        args.decode_case, args.prefill_case = (64, 2048), (4, 512, 512)
        args.tune_cases = [] if args.quick else [(64, 8192), (256, 1024)]
        name = torch.cuda.get_device_name()
        copy_gbs = copy_bandwidth_gbs()
    torch.manual_seed(0)
    log(f"{name}: device copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    sweep = decode_sweep(args, copy_gbs)
    ops = kernel_vs_reference(args)
    tuning = decode_tuning(args, copy_gbs)

    shape = f"{args.heads} q heads, {args.kv_heads} KV heads, head dim {args.head_dim}, bf16"
    print(f"\n## Paged decode attention on {name} ({shape})\n")
    print(f"Device copy bandwidth: {copy_gbs:.0f} GB/s (read + write). Target: >= 70%.\n")
    print(markdown_table(
        ["batch", "context", "splits", "time ms", "GB/s", "% of copy", "max abs err"],
        [[r["batch"], r["context"], r["splits"], fmt(r["ms"], 3), fmt(r["gb_per_s"], 0),
          fmt(100 * r["fraction_of_copy"], 1), f"{r['max_abs_err']:.1e}"] for r in sweep]))
    print(f"\n## Each kernel against its torch reference ({args.tokens} tokens)\n")
    print(markdown_table(
        ["op", "triton us", "reference us", "speedup", "triton GB/s", "host us / launch"],
        [[r["op"], fmt(r["triton_us"], 1), fmt(r["reference_us"], 1), fmt(r["speedup"], 1),
          fmt(r["triton_gb_per_s"], 0), fmt(r["host_us_per_launch"], 1)] for r in ops]))
    if tuning:
        print("\n## Decode launch settings (default: block_n 64, 4 warps, 2 stages)\n")
        print(markdown_table(
            ["batch", "context", "block_n", "warps", "stages", "time ms", "% of copy"],
            [[r["batch"], r["context"], r["block_n"], r["num_warps"], r["num_stages"],
              fmt(r["ms"], 3), fmt(100 * r["fraction_of_copy"], 1)] for r in tuning]))
    worst = min(r["fraction_of_copy"] for r in sweep)
    print(f"\nLowest decode fraction of copy bandwidth: {100 * worst:.1f}% "
          f"({'meets' if worst >= 0.7 else 'misses'} the 70% target)")
    target = [r for r in sweep if (r["batch"], r["context"]) == (64, 8192)]
    if target:
        frac = target[0]["fraction_of_copy"]
        print(f"Target case, batch 64 x 8k: {100 * frac:.1f}% of copy bandwidth "
              f"({'meets' if frac >= 0.7 else 'misses'} >= 70%)")
    path = write_json(args.out, {"device": name, "copy_gb_per_s": copy_gbs,
                                 "attention_shape": shape, "decode": sweep, "ops": ops,
                                 "decode_tuning": tuning,
                                 "torch": torch.__version__})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
