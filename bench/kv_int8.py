"""The 8-bit KV cache (`--kv-cache-dtype int8`) against the float16 cache on the real model.

Accuracy, on five prompts: each cache's greedy tokens over `--steps` decode steps (where the
int8 run first leaves the float16 run's tokens, if it does), and the logits of the same
sequences (each prompt followed by the float16 run's tokens, one teacher-forced pass) as
max / mean absolute error against the float16 cache; the float32 cache is the reference both
are measured against too. Speed: a steady decode step of `--seqs` sequences at `--context`
tokens each, int8 and float16 caches, and attention's share of it (the C decode attention
alone over the step's caches and block tables for every layer, divided by the whole step).

    python -m bench.kv_int8                 # 64 steps, 64 sequences at 512 tokens
    python -m bench.kv_int8 --quick         # a smoke run at a tiny size (measures little)
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import fmt, log, markdown_table, median

PROMPTS = ["The history of the Roman Empire begins with",
           "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
           "Explain why the sky is blue to a ten-year-old.",
           "List three ways to save energy at home:\n1.",
           "Water boils at a lower temperature on a mountain because"]
CACHES = ("float32", "float16", "int8")


def make_engine(checkpoint, kv_dtype: str, kv_bytes: int = 512 << 20, batched: int = 512):
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    return LLMEngine(checkpoint, EngineConfig(kv_cache_dtype=kv_dtype, kv_cache_bytes=kv_bytes,
                                              max_num_batched_tokens=batched))


def accuracy(checkpoint, steps: int = 64, prompts: list[str] = PROMPTS) -> dict:
    """Greedy tokens and teacher-forced logits of every cache in CACHES (see the module)."""
    from contract.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    tokens, logits, rows = {}, {}, None
    for kv_dtype in ("float16", "float32", "int8"):  # float16's tokens are the sequences
        engine = make_engine(checkpoint, kv_dtype)
        ids = [engine.tokenizer.encode(p) for p in prompts]
        tokens[kv_dtype] = engine.generate(ids, greedy)
        seqs = [p + t for p, t in zip(ids, tokens["float16"])]
        # the logits that chose each generated token: positions len(prompt) - 1 ..
        logits[kv_dtype] = [engine.prompt_logits(s)[len(p) - 1:len(s) - 1]
                            for p, s in zip(ids, seqs)]
        if kv_dtype == "float32":
            rows = _cache_rows(engine)
        engine.close()
    out: dict = {"steps": steps, "prompts": len(prompts), "tokens": tokens,
                 "kv_error_ratio": _error_ratio(rows)}
    for kv_dtype, against in (("int8", "float16"), ("int8", "float32"),
                              ("float16", "float32")):
        diff = torch.cat([(a - b).abs().flatten() for a, b in
                          zip(logits[kv_dtype], logits[against])])
        out[f"{kv_dtype}_vs_{against}"] = {"max": float(diff.max()), "mean": float(diff.mean())}
    out["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                               for x, y in zip(tokens["int8"], tokens["float16"])]
    out["agreeing_tokens"] = sum(sum(a == b for a, b in zip(x, y))
                                 for x, y in zip(tokens["int8"], tokens["float16"]))
    return out


def _cache_rows(engine) -> torch.Tensor:
    """Every row the float32 engine wrote (its K and V rows of every layer), [rows, D]."""
    rows = torch.cat([torch.stack((k, v)).reshape(-1, k.shape[-1])
                      for k, v in engine.runner.kv_caches])
    return rows[rows.abs().amax(-1) > 0]


def _error_ratio(rows: torch.Tensor) -> float:
    """RMS of the int8 quantization error over RMS of the float16 rounding error, on the
    model's own K/V rows: to first order the logits move in proportion to it."""
    from kernels import kv_int8
    e8 = kv_int8.dequantize_rows(kv_int8.quantize_rows(rows)) - rows
    e16 = rows.half().float() - rows
    return float(e8.pow(2).mean().sqrt() / e16.pow(2).mean().sqrt())


def decode_step(checkpoint, kv_dtype: str, seqs: int, context: int, steps: int) -> dict:
    """A steady decode step of `seqs` sequences at about `context` tokens: its median time
    and the median time of the C decode attention alone over every layer of it."""
    import kernels
    from contract.sampling_params import SamplingParams
    engine = make_engine(checkpoint, kv_dtype, kv_bytes=1 << 30,
                         batched=max(512, context))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"s{i}", [(7 * i + 13 * j) % (vocab - 10) + 5
                                     for j in range(context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(8):  # past the first decode steps (and the thread governor's trials)
        engine.step()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    cfg, runner = engine.model_config, engine.runner
    ids = [engine.kv.block_ids(rid) for rid in engine.requests]
    width = max(len(b) for b in ids)
    tables = torch.tensor([b + [0] * (width - len(b)) for b in ids], dtype=torch.long)
    lens = torch.tensor([r.num_computed_tokens for r in engine.requests.values()])
    q = torch.randn(len(ids), cfg.num_attention_heads, cfg.head_dim)
    attn_times = []
    for _ in range(steps):
        start = time.perf_counter()
        for k_cache, v_cache in runner.kv_caches:
            kernels.paged_decode_attention(q, k_cache, v_cache, None, None, cfg.head_dim ** -0.5,
                                           block_tables=tables, context_lens=lens,
                                           block_size=runner.block_size)
        attn_times.append(time.perf_counter() - start)
    kv_bytes = sum(k.element_size() * k[0].numel() * 2 for k, _ in runner.kv_caches)
    engine.close()
    step, attn = median(step_times), median(attn_times)
    return {"kv_dtype": kv_dtype, "step_ms": step * 1e3, "attention_ms": attn * 1e3,
            "attention_share": attn / step, "kv_bytes_per_token": kv_bytes,
            "tokens_in_1_gib": (1 << 30) // kv_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="greedy steps a prompt")
    ap.add_argument("--seqs", type=int, default=64, help="decoding sequences of the step")
    ap.add_argument("--context", type=int, default=512, help="tokens a sequence holds")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seqs, args.context = 8, 4, 32
    from runtime.loading.loader import default_model_path, load_checkpoint
    checkpoint = load_checkpoint(default_model_path())
    log("accuracy ...")
    acc = accuracy(checkpoint, args.steps)
    speed = []
    for kv_dtype in ("float16", "int8"):
        log(f"decode step, {kv_dtype} cache ...")
        speed.append(decode_step(checkpoint, kv_dtype, args.seqs, args.context,
                                 max(4, args.steps // 4)))
    print(markdown_table(
        ["logits", "max abs error", "mean abs error"],
        [[k.replace("_", " "), fmt(acc[k]["max"], 4), fmt(acc[k]["mean"], 5)]
         for k in ("int8_vs_float16", "int8_vs_float32", "float16_vs_float32")]))
    print(f"\ngreedy: {acc['agreeing_tokens']} of {acc['prompts'] * acc['steps']} int8 tokens "
          f"equal to float16's; first divergence step per prompt: {acc['first_divergence']}; "
          f"int8/float16 K/V error RMS ratio {acc['kv_error_ratio']:.1f}\n")
    print(markdown_table(
        ["cache", f"{args.seqs}-seq step ms", "attention ms", "attention share",
         "KV bytes/token", "tokens in 1 GiB"],
        [[s["kv_dtype"], fmt(s["step_ms"]), fmt(s["attention_ms"]),
          f"{s['attention_share']:.0%}", s["kv_bytes_per_token"], f"{s['tokens_in_1_gib']:,}"]
         for s in speed]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": acc, "decode_step": speed, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
