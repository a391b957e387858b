"""Our engine against Hugging Face transformers' `generate`, side by side in one run.

Scenarios (same token ids, same output lengths for both systems, greedy, EOS ignored):
  single  one request at a time: decode tokens/s and time to first token.
  N       N requests (e.g. 32, 64) of mixed prompt lengths and mixed output lengths, arriving
          at random over a few seconds: our engine adds each request as it arrives and batches
          continuously; transformers runs static left-padded batches of N requests in arrival
          order, each starting once its last member has arrived (and the previous one ended)
          and running to its longest output. Useful output tokens/s counts only the drawn
          output lengths; TTFT = first output token time - arrival time.

The same run measures the machine's limits (copy bandwidth, float32 matmul rate, the model's
linear layers alone at several batch sizes) and reports each system's fraction of the
linear-layer bound (definition printed with the results).

    python -m bench.engine                 # full run (~15-20 min on 2 cores)
    python -m bench.engine --quick         # smoke run (~2-3 min)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from bench import common
from bench.common import fmt, log, markdown_table, median, percentile
from bench.engine_servers import OUTPUT_TOKENS
from bench.engine_systems import RunResult, load_hf, run_hf, run_ours
from bench.engine_workloads import Req, make_requests


# ---- bounds -----------------------------------------------------------------------------
def workload_bound(reqs: list[Req], batch: int, prof: common.LinearProfile) -> float:
    """Linear layers alone for the workload's useful work at the scenario's batch size:
    every prompt token at the cheapest per-token (large-batch) cost, plus each request's
    first-token lm_head row at batch `batch`, plus every later output token as 1/batch of a
    decode step of `batch` sequences."""
    prompt = sum(len(r.prompt) for r in reqs)
    decode = sum(r.max_tokens - 1 for r in reqs)
    return (prompt * prof.prefill_per_token() + len(reqs) * prof.lm_head(batch) / batch
            + decode * prof.full(batch) / batch)


BOUND_DEFINITION = """\
Linear-layer bound: `F.linear` on the model's real fused weights (30 x [qkv, o, gate_up, down]
+ lm_head) with random inputs, minimum of repeats; attention, norms, sampling excluded.
  single: decode bound = linear(1) per output token after the first; fraction = that / the
          measured decode time (first -> last token, summed over requests).
  N reqs: workload bound = prompt tokens x cheapest per-token layer cost (large batch)
          + output tokens x linear(B)/B, B = N (lm_head only on rows that need logits);
          fraction = bound / wall time (first arrival -> last token). Arrival gaps count.
  step bound (extra column): linear time of the steps each system actually ran (its own
          batch sizes, padding and finished rows included) / its busy time (inside
          step() or generate()): how much of each step is linear-layer work, whatever the
          scheduling."""


def served_form(linear):
    """A quantized Linear's packed form: the file's own blocks (int4), else int8."""
    return linear.small if linear.small is not None else linear.packed


# ---- main -------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 short single request, one scenario of 8 small requests")
    p.add_argument("--scenarios", default=None,
                   help="comma list of 'single' and request counts (default single,32,64; "
                        "quick: single,8; 'none': only --servers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results path (default "
                   "bench/results/engine.json; quick: bench/results/engine-quick.json)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--model", default=None, help="GGUF path (default: the shipped SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--prompt-len", default=None, help="min,max prompt tokens (default 20,500)")
    p.add_argument("--output-len", default=None, help="min,max output tokens (default 16,256)")
    p.add_argument("--arrival-window", type=float, default=None,
                   help="requests arrive over about this many seconds (default 4)")
    p.add_argument("--single-prompts", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--single-tokens", type=int, default=None, help="default 128 (quick: 16)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="transformers' static batch size (default: the scenario's N)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache budget of our engine")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn our prefix cache off (prompts are distinct either way)")
    p.add_argument("--quantization", default="auto",
                   help="our engine's weights: auto (as `make run`), none, int8, int4")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="our engine's KV cache: auto (as `make run`), float32, float16, "
                        "bfloat16")
    p.add_argument("--servers", default=None,
                   help="comma list of concurrent streams for ours against llama.cpp's server "
                        "over HTTP (e.g. 1,8,32,64; default: skipped; builds llama-server "
                        "once with bench/peers/build_llama_server.sh)")
    p.add_argument("--busy-streams", default="8",
                   help="stream counts measured again with one core kept busy (with --servers)")
    p.add_argument("--busy-peer", action="store_true",
                   help="measure llama.cpp's server with the busy core too (slow: over ten "
                        "minutes at 8 streams on a 2-core VM)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: ours (CUDA graphs on and off) against transformers on the same "
                        "GPU in bfloat16 (bench/engine_cuda.py); default scenarios single,64,256 "
                        "arriving at once")
    p.add_argument("--cuda-graphs", default="both", choices=("on", "off", "both"),
                   help="with --device cuda: our engine with CUDA graphs on, off, or both")
    a = p.parse_args(argv)
    q = a.quick
    if a.device == "cuda":  # a GPU's own defaults: concurrent requests, up to 256 of them
        a.scenarios = a.scenarios or ("single,64" if q else "single,64,256")
        a.arrival_window = a.arrival_window if a.arrival_window is not None else 0.0
    a.out = a.out or f"bench/results/engine{'-' + a.device if a.device != 'cpu' else ''}" \
                     f"{'-quick' if q else ''}.json"
    a.scenarios = [s.strip() for s in (a.scenarios or ("single,8" if q else "single,32,64"))
                   .split(",") if s.strip() and s.strip() != "none"]
    for s in a.scenarios:
        if s != "single" and not s.isdigit():
            p.error(f"bad scenario {s!r}: use 'single' or a request count")
    rng2 = lambda s, d: tuple(int(x) for x in (s or d).split(","))  # noqa: E731
    a.prompt_len = rng2(a.prompt_len, "20,120" if q else "20,500")
    a.output_len = rng2(a.output_len, "8,32" if q else "16,256")
    a.arrival_window = a.arrival_window if a.arrival_window is not None else (1.0 if q else 4.0)
    a.single_prompts = a.single_prompts or (1 if q else 3)
    a.single_tokens = a.single_tokens or (16 if q else 128)
    return a


def run_against_llama(args, path: str, engine) -> dict | None:
    """--servers: ours (as `make run` starts it) against llama.cpp's server over HTTP, each
    alone on the machine; printed, and returned for the JSON."""
    if not args.servers:
        return None
    from bench.engine_servers import load_average, run_servers, servers_report
    streams = [int(x) for x in args.servers.split(",") if x.strip()]
    busy = [int(x) for x in args.busy_streams.split(",") if x.strip()]
    load = load_average()
    runs = run_servers(path, streams, busy, common.num_cores(),
                       our_flags=["--quantization", args.quantization], log=log,
                       busy_peer=args.busy_peer)
    table, summary = servers_report(runs)
    print(f"\nOurs against llama.cpp's server over HTTP (chat prompts, {OUTPUT_TOKENS} output "
          f"tokens each, EOS ignored, streamed, counted at the client; 1-min load {load:.2f} "
          f"before, {load_average():.2f} after; our weights {engine.runner.model.quantization}):")
    print(table)
    return {"summary": summary, "table_markdown": table,
            "runs": [dict(vars(r), tok_s=r.tok_s) for r in runs]}


def warm_up(engine, hf, reqs: list[Req], pad_id: int) -> None:
    run_ours(engine, reqs)
    if hf is not None:
        run_hf(hf, reqs, len(reqs), pad_id)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        from bench.engine_cuda import main_cuda
        return main_cuda(args)
    threads = common.setup_threads(args.threads)
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.loading.loader import default_model_path, load_checkpoint

    t_start = time.perf_counter()
    load0 = common.machine_info()["load_avg_1min"]
    if load0 is not None and load0 > 0.5:
        log(f"[bench] WARNING: 1-min load average is {load0:.2f} before start: other work "
            f"shares the cores and will distort every number (with {threads} threads each "
            f"small matmul can wait a scheduler tick for a busy core)")
    path = args.model or default_model_path()
    log(f"[bench] threads={threads}; loading {os.path.basename(path)} ...")
    ck = load_checkpoint(path)
    engine = LLMEngine(ck, EngineConfig(max_num_seqs=args.max_num_seqs,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        kv_cache_bytes=int(args.kv_gib * (1 << 30)),
                                        enable_prefix_caching=not args.no_prefix_caching,
                                        seed=args.seed, quantization=args.quantization,
                                        kv_cache_dtype=args.kv_cache_dtype))
    log(f"[bench] our weights: {engine.runner.model.quantization}, KV cache: "
        f"{str(engine.runner.kv_dtype).removeprefix('torch.')}")
    hf = None
    if not args.skip_transformers:
        log("[bench] loading transformers reference (dequantizes the GGUF) ...")
        hf = load_hf(path)
    tok = ck.tokenizer
    eos = list(ck.config.eos_token_ids)
    pad_id = eos[0] if eos else 0

    # workloads, deterministic from the seed
    rng = random.Random(args.seed)
    workloads: dict[str, list[Req]] = {}
    for s in args.scenarios:
        if s == "single":
            workloads[s] = make_requests(tok, rng, args.single_prompts, args.prompt_len,
                                         (args.single_tokens, args.single_tokens), 0.0, "single")
        else:
            workloads[s] = make_requests(tok, rng, int(s), args.prompt_len, args.output_len,
                                         args.arrival_window, f"n{s}")
    warm = make_requests(tok, random.Random(args.seed + 1), 2, (16, 48), (4, 4), 0.0, "warm")

    # machine limits
    log("[bench] measuring machine limits ...")
    bw = common.copy_bandwidth_gbs(64 << 20 if args.quick else 256 << 20)
    read_bw = common.read_bandwidth_gbs(64 << 20 if args.quick else 256 << 20)
    gflops = common.matmul_gflops(1024 if args.quick else 2048)
    model = engine.runner.model
    linears = model.linears()  # the head last
    weights = [lin.weight for lin in linears[:-1]]
    quantized = model.quantization != "none"
    sizes = ([1, 8, 32, 64, 256] if args.quick
             else [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512])
    measure = lambda: common.measure_linear(  # noqa: E731
        weights, model.lm_head.weight, sizes, reps=2 if args.quick else 3,
        min_total_s=0.2 if args.quick else 1.0,
        packed=[served_form(lin) for lin in linears[:-1]] if quantized else None,
        packed_head=served_form(model.lm_head))
    prof = measure()

    log("[bench] warming up both systems ...")
    warm_up(engine, hf, warm, pad_id)

    results: dict[str, dict] = {}
    for name, reqs in workloads.items():
        n = len(reqs)
        log(f"[bench] scenario {name}: {n} requests, "
            f"{sum(len(r.prompt) for r in reqs)} prompt tokens, "
            f"{sum(r.max_tokens for r in reqs)} output tokens")
        runs: list[RunResult] = []
        if name == "single":  # one request at a time, back to back, for each system
            parts = {"ours": [], "transformers": []}
            for r in reqs:
                solo = [Req(r.rid, r.prompt, r.max_tokens, 0.0)]
                parts["ours"].append(run_ours(engine, solo))
                if hf is not None:
                    parts["transformers"].append(run_hf(hf, solo, 1, pad_id))
            for system, rs in parts.items():
                if rs:
                    runs.append(RunResult(
                        system, sum(x.wall_s for x in rs), sum(x.useful_tokens for x in rs),
                        [t for x in rs for t in x.ttft_s],
                        decode_tokens=sum(x.decode_tokens for x in rs),
                        decode_s=sum(x.decode_s for x in rs),
                        step_rows=[row for x in rs for row in x.step_rows],
                        busy_s=sum(x.busy_s for x in rs),
                        prompt_tokens_run=sum(x.prompt_tokens_run for x in rs),
                        steps=sum(x.steps for x in rs),
                        extra={"prefix_cached_tokens": sum(x.extra.get("prefix_cached_tokens", 0)
                                                           for x in rs)}))
        else:
            runs.append(run_ours(engine, reqs))
            log(f"[bench]   ours: {runs[-1].wall_s:.1f} s, {runs[-1].preemptions} preemptions, "
                f"{runs[-1].extra['prefix_cached_tokens']} prompt tokens from the prefix cache")
            if hf is not None:
                runs.append(run_hf(hf, reqs, args.hf_batch_size or n, pad_id))
                log(f"[bench]   transformers: {runs[-1].wall_s:.1f} s")
        results[name] = {"requests": [{"id": r.rid, "prompt_tokens": len(r.prompt),
                                       "output_tokens": r.max_tokens, "arrival_s": r.arrival}
                                      for r in reqs],
                         "runs": {x.system: x for x in runs}}

    # the linear layers again after the scenarios; the bound uses the faster of the two
    log("[bench] measuring the linear layers again ...")
    prof_before = prof
    prof = prof_before.merged_min(measure())
    if prof.meta["max_spread"] > 1.2:
        log(f"[bench] WARNING: linear-layer times before and after differ by up to "
            f"{100 * (prof.meta['max_spread'] - 1):.0f}%: the machine was not quiet")
    for name, res in results.items():
        reqs = workloads[name]
        res["bound_s"] = (sum(r.max_tokens - 1 for r in reqs) * prof.full(1) if name == "single"
                          else workload_bound(reqs, min(len(reqs), args.max_num_seqs), prof))
        for x in res["runs"].values():
            x.extra["step_bound_s"] = x.step_bound_s(prof)
    # ---- report ---------------------------------------------------------------------
    rows, summary = [], {}
    for name, res in results.items():
        runs, bound = res["runs"], res["bound_s"]
        single = name == "single"
        hf_run = runs.get("transformers")
        for system, x in runs.items():
            rate = x.decode_tok_s if single else x.tok_s
            ref = (hf_run.decode_tok_s if single else hf_run.tok_s) if hf_run else None
            ratio = rate / ref if ref else float("nan")
            frac = bound / (x.decode_s if single else x.wall_s)
            step_frac = x.extra["step_bound_s"] / x.busy_s
            summary.setdefault(name, {})[system] = {
                "tok_s": rate, "ratio_vs_transformers": ratio, "fraction_of_bound": frac,
                "fraction_of_step_bound": step_frac}
            label = (f"single ({len(res['requests'])}x{res['requests'][0]['output_tokens']} tok,"
                     f" decode)" if single else f"{name} requests")
            rows.append([label, system, fmt(rate, 1), fmt(median(x.ttft_s), 2),
                         fmt(percentile(x.ttft_s, 90), 2),
                         fmt(ratio, 2) + "x" if ratio == ratio else "n/a",
                         f"{100 * frac:.0f}%", f"{100 * step_frac:.0f}%"])
    table = markdown_table(["scenario", "system", "output tok/s", "median TTFT s", "p90 TTFT s",
                            "vs transformers", "of linear bound", "of step bound"], rows)

    info = common.machine_info()
    # what a small step reads: the packed weights of a quantized model, else the float ones
    served = prof.meta.get("packed_bytes") or prof.weight_bytes
    lines = [f"Machine: {info['cpu']}, {threads} threads, torch {torch.__version__}; "
             f"1-min load average {fmt(load0)} at start, {fmt(info['load_avg_1min'])} at end "
             f"(includes this run)",
             f"  copy bandwidth:   {bw:.1f} GB/s copied = {2 * bw:.1f} GB/s of memory traffic "
             f"(read + write); read bandwidth (sum) {read_bw:.1f} GB/s",
             f"  float32 matmul:   {gflops:.1f} GFLOP/s",
             f"  linear layers alone (weights {prof.weight_bytes / 1e6:.0f} MB in float32, "
             f"{served / 1e6:.0f} MB as a small step reads them):"]
    for b in (1, 32, 64):
        t = prof.full(b)
        lines.append(f"    batch {b:>3}: {1e3 * t:7.1f} ms/step = {b / t:6.1f} tok/s ceiling "
                     f"({(prof.flops_per_token + prof.lm_head_flops_per_row) * b / t / 1e9:.1f}"
                     f" GFLOP/s, {served / t / 1e9:.1f} GB/s of weights as served)")
    lines.append(f"    prefill per token (large batch): {1e3 * prof.prefill_per_token():.2f} ms; "
                 f"measured before and after the scenarios, faster kept (max spread "
                 f"{100 * (prof.meta['max_spread'] - 1):.0f}%: large = noisy machine)")
    fl = prof.flops_per_token + prof.lm_head_flops_per_row
    if "single" in summary and "ours" in summary["single"]:
        s = summary["single"]["ours"]
        lines.append(f"  ours at one request: {s['tok_s']:.1f} tok/s decode = "
                     f"{100 * s['fraction_of_bound']:.0f}% of the batch-1 linear bound; "
                     f"weights read at {s['tok_s'] * served / 1e9:.1f} GB/s = "
                     f"{100 * s['tok_s'] * served / 1e9 / read_bw:.0f}% of the read "
                     f"bandwidth")
    for name in summary:
        if name != "single" and "ours" in summary[name]:
            x = results[name]["runs"]["ours"]
            work = (x.prompt_tokens_run * prof.flops_per_token
                    + x.decode_tokens * fl + len(results[name]["requests"])
                    * prof.lm_head_flops_per_row)
            lines.append(f"  ours at {name} requests: {work / x.wall_s / 1e9:.1f} GFLOP/s of "
                         f"linear work = {100 * work / x.wall_s / 1e9 / gflops:.0f}% of the "
                         f"matmul rate; {100 * summary[name]['ours']['fraction_of_bound']:.0f}%"
                         f" of the linear bound")
    targets = []
    for name, need_ratio, need_frac in (("single", 1.2, 0.80), ("64", 2.0, 0.75)):
        o = summary.get(name, {}).get("ours")
        if o:
            targets.append(f"  {name}: ratio {fmt(o['ratio_vs_transformers'])}x (target "
                           f">= {need_ratio}x), bound {100 * o['fraction_of_bound']:.0f}% "
                           f"(target >= {100 * need_frac:.0f}%)")

    print()
    print("\n".join(lines))
    print()
    print(table)
    print()
    print(BOUND_DEFINITION)
    if targets:
        print("\nTargets:\n" + "\n".join(targets))
    servers = run_against_llama(args, path, engine)
    elapsed = time.perf_counter() - t_start
    print(f"\n(seed {args.seed}; {'quick' if args.quick else 'full'} run; {elapsed:.0f} s)")

    out = common.write_json(args.out, {
        "benchmark": "engine", "args": vars(args), "machine": info, "load_avg_at_start": load0,
        "limits": {"copy_gbs": bw, "copy_traffic_gbs": 2 * bw, "read_gbs": read_bw,
                   "matmul_gflops": gflops,
                   "linear": prof, "linear_before": prof_before},
        "engine_config": {"max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "kv_gib": args.kv_gib},
        "bound_definition": BOUND_DEFINITION, "summary": summary, "scenarios": results,
        "table_markdown": table, "servers": servers, "elapsed_s": elapsed})
    log(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
