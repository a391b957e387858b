"""bench/engine.py --device cuda: our engine on a GPU, CUDA graphs on and off, against Hugging
Face transformers' `generate` on the same GPU and the same weights, in bfloat16.

Scenarios as on the CPU (bench/engine.py), by default single, 64 and 256 requests arriving at
once (--arrival-window 0): N concurrent requests for our engine, static left-padded batches
of N for transformers. Our engine runs with room for every request at once (max_num_seqs >= N)
and a larger token budget than on the CPU (at least 8192 tokens a step).

The batch-1 bound is the weights-read bound: one decode step must read every weight once, so
it takes at least (bytes of the model's matrices) / (the device's copy bandwidth, bytes read
plus written per second, as bench/kernels.py measures it). Targets: a batch-1 decode step
within 1.5x of that bound, and at least 10x transformers' output tokens/s at 256 requests.

Without the SmolLM2 GGUF (the GPU machine cannot download it) `--model random-smollm2` builds
a random-weight folder of SmolLM2's exact shape: same speed, meaningless text.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from bench import common
from bench.common import fmt, log, markdown_table, median, percentile
from bench.engine_systems import RunResult, load_hf, run_hf, run_ours
from bench.engine_workloads import Req, make_requests

RANDOM_MODEL = "random-smollm2"
SMOLLM2_SHAPE = dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536,
                     max_len=8192, tied=True)
SMOLLM2_VOCAB = 49152


def random_smollm2(folder: Path) -> str:
    """A Hugging Face folder with SmolLM2-135M's shape and random weights (tests' tokenizer,
    SmolLM2's vocabulary size); built once."""
    from testkit.tiny_model import random_weights, write_tiny_checkpoint
    if not (folder / "model.safetensors").exists():
        from safetensors.torch import save_file
        write_tiny_checkpoint(folder, **SMOLLM2_SHAPE)
        config = json.loads((folder / "config.json").read_text())
        config["vocab_size"] = SMOLLM2_VOCAB
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        save_file(random_weights(config, 0), str(folder / "model.safetensors"))
    return str(folder)


def device_copy_gbs(nbytes: int = 1 << 30) -> float:
    """A device-to-device copy: bytes read plus bytes written per second (GB/s), best of 5."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / best / 1e9


def matrix_bytes(engine) -> int:
    """Bytes a decode step must read: every linear weight, the LM head included."""
    return sum(lin.weight.numel() * lin.weight.element_size()
               for lin in engine.runner.model.linears())


def make_engine(ck, args, graphs: bool, max_seqs: int, overlap: str = "auto"):
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    return LLMEngine(ck, EngineConfig(
        device="cuda", cuda_graphs=graphs, max_num_seqs=max_seqs, overlap=overlap,
        max_num_batched_tokens=max(args.max_num_batched_tokens, 8192),
        kv_cache_bytes=int(max(args.kv_gib, 16.0) * (1 << 30)),
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed))


def run_single(system, run, reqs: list[Req]) -> RunResult:
    """One request at a time, back to back; the runs summed."""
    parts = [run([Req(r.rid, r.prompt, r.max_tokens, 0.0)]) for r in reqs]
    return RunResult(system, sum(x.wall_s for x in parts), sum(x.useful_tokens for x in parts),
                     [t for x in parts for t in x.ttft_s],
                     decode_tokens=sum(x.decode_tokens for x in parts),
                     decode_s=sum(x.decode_s for x in parts),
                     busy_s=sum(x.busy_s for x in parts), steps=sum(x.steps for x in parts))


def main_cuda(args) -> int:
    if not torch.cuda.is_available():
        log("bench/engine.py --device cuda needs a CUDA GPU")
        return 2
    from runtime.loading.loader import default_model_path, load_checkpoint
    t_start = time.perf_counter()
    path = args.model or default_model_path()
    if path == RANDOM_MODEL:
        path = random_smollm2(Path(common.REPO_ROOT) / "bench" / "results" / RANDOM_MODEL)
    log(f"[bench] {torch.cuda.get_device_name()}; loading {os.path.basename(path)} ...")
    ck = load_checkpoint(path)
    counts = [int(s) for s in args.scenarios if s != "single"]
    max_seqs = max([args.max_num_seqs, *counts])
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.cuda_graphs]
    engines = {f"ours, graphs {'on' if g else 'off'}": make_engine(ck, args, g, max_seqs)
               for g in modes}
    if True in modes:  # the overlap scheduler's share: the same graphs, steps in order
        engines["ours, graphs on, overlap off"] = make_engine(ck, args, True, max_seqs, "off")
    hf = None
    if not args.skip_transformers:
        log("[bench] loading transformers on the same GPU (bfloat16) ...")
        hf = load_hf(path, device="cuda", dtype=torch.bfloat16)
    tok = ck.tokenizer
    eos = list(ck.config.eos_token_ids)
    pad_id = eos[0] if eos else 0
    rng = random.Random(args.seed)
    workloads = {s: (make_requests(tok, rng, args.single_prompts, args.prompt_len,
                                   (args.single_tokens, args.single_tokens), 0.0, "single")
                     if s == "single" else
                     make_requests(tok, rng, int(s), args.prompt_len, args.output_len,
                                   args.arrival_window, f"n{s}"))
                 for s in args.scenarios}
    copy_gbs = device_copy_gbs()
    first = next(iter(engines.values()))
    weight_bytes = matrix_bytes(first)
    bound_ms = 1e3 * weight_bytes / (copy_gbs * 1e9)
    log(f"[bench] copy bandwidth {copy_gbs:.0f} GB/s; matrices {weight_bytes / 1e6:.0f} MB: "
        f"weights-read bound {bound_ms:.3f} ms per decode step")
    warm = make_requests(tok, random.Random(args.seed + 1), 8, (16, 200), (8, 8), 0.0, "warm")
    for engine in engines.values():
        run_ours(engine, warm)
    if hf is not None:
        run_hf(hf, warm, len(warm), pad_id)

    rows, summary = [], {}
    for name, reqs in workloads.items():
        log(f"[bench] scenario {name}: {len(reqs)} requests")
        runs: dict[str, RunResult] = {}
        for system, engine in engines.items():
            run = lambda rs, e=engine: run_ours(e, rs)  # noqa: E731
            runs[system] = run_single(system, run, reqs) if name == "single" else run(reqs)
        if hf is not None:
            run = lambda rs: run_hf(hf, rs, len(rs), pad_id)  # noqa: E731 - a static batch of all
            runs["transformers"] = run_single("transformers", run, reqs) \
                if name == "single" else run(reqs)
        ref = runs.get("transformers")
        for system, x in runs.items():
            rate = x.decode_tok_s if name == "single" else x.tok_s
            base = (ref.decode_tok_s if name == "single" else ref.tok_s) if ref else None
            step_ms = 1e3 * x.decode_s / x.decode_tokens if name == "single" else None
            summary.setdefault(name, {})[system] = {
                "tok_s": rate, "ratio_vs_transformers": rate / base if base else None,
                "decode_step_ms": step_ms,
                "step_vs_weights_bound": step_ms / bound_ms if step_ms else None,
                "ttft_median_s": median(x.ttft_s), "ttft_p90_s": percentile(x.ttft_s, 90)}
            s = summary[name][system]
            rows.append([name, system, fmt(rate, 0), fmt(s["ratio_vs_transformers"]),
                         fmt(step_ms, 3), fmt(s["step_vs_weights_bound"]),
                         fmt(s["ttft_median_s"], 3)])
    table = markdown_table(["scenario", "system", "output tok/s (single: decode)",
                            "vs transformers", "decode step ms", "vs weights bound",
                            "median TTFT s"], rows)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_gbs:.0f} GB/s (read + write); matrices {weight_bytes / 1e6:.0f} MB; "
          f"weights-read bound {bound_ms:.3f} ms per decode step\n")
    print(table)
    targets = []
    single = summary.get("single", {})
    for system, s in single.items():
        if system.startswith("ours"):
            targets.append(f"  batch-1 decode step, {system}: {fmt(s['step_vs_weights_bound'])}x "
                           f"the weights-read bound (target <= 1.5x)")
    for system, s in summary.get("256", {}).items():
        if system.startswith("ours"):
            targets.append(f"  256 requests, {system}: {fmt(s['ratio_vs_transformers'])}x "
                           f"transformers (target >= 10x)")
    if targets:
        print("\nTargets:\n" + "\n".join(targets))
    elapsed = time.perf_counter() - t_start
    out = common.write_json(args.out, {
        "benchmark": "engine-cuda", "args": vars(args), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "copy_gb_per_s": copy_gbs, "matrix_bytes": weight_bytes,
        "weights_read_bound_ms": bound_ms, "summary": summary, "table_markdown": table,
        "scenarios": {n: {"requests": len(w)} for n, w in workloads.items()},
        "elapsed_s": elapsed})
    log(f"[bench] wrote {out} ({elapsed:.0f} s)")
    return 0
