"""Speculative decoding off against each proposer, side by side in one run, on the real model.

Proposers (`--proposers`, comma-separated):
  off        no speculation: the reference every speedup is measured against.
  ngram      prompt lookup: propose what followed the latest earlier occurrence of the last
             few tokens (prompt and output). No model.
  self:L     the target's own first L layers (and its final norm and LM head) draft greedily.
  draft:N    a separate draft model: the target's first N layers written out as a Hugging Face
             folder (runtime.spec_decode.make_draft.write_draft) in a temporary directory.
             (draft:PATH with a non-numeric PATH loads that model as is.)

Workloads (chat-template user messages, greedy, EOS honoured, `max_tokens` caps the answer):
  extractive  "rewrite this code with snake_case names" over invented camelCase code, and
              "correct the spelling" over invented paragraphs with seeded letter-swap typos.
              Passages are ~150-300 tokens, so the answer mostly copies the passage.
  chat        ordinary open questions ("Give three tips for learning to cook", ...).

Concurrency:
  1  the scenario's prompts (default 2: extractive = one code, one prose) run one after another
     (each submitted when the previous finished);
  8  eight prompts submitted at once, each with half the max_tokens (to keep the run short).
     With the default spec_max_batch=8 the governor still lets a batch of 8 decoding requests
     speculate; above it, it would not.

Every (workload, concurrency) scenario runs every proposer in turn before the next scenario,
in a rotating order, so the machine's noise reaches every proposer alike. Each proposer has its
own engine (prefix caching off, so no scenario is helped by an earlier one) warmed up with a
short unrelated batch before anything is measured.

Definitions (per scenario and proposer):
  tokens     generated tokens (sum of every request's output tokens).
  tok/s      tokens / wall time from the first submission until the last request finishes
             (prefill included: the draft model's own prefill is part of its cost).
  decode/s   tokens produced in steps that ran no prefill / those steps' time: the decode loop
             alone.
  speedup    tok/s over the `off` tok/s of the same scenario in the same run.
  accept     accepted draft tokens / proposed draft tokens (engine counters).
  mean len   accepted tokens per verification + 1: tokens per target forward in the steps
             where a request speculated (1.0 would be plain decoding).
  spec%      verifications / request-steps that produced tokens: the fraction of request-steps
             that speculated (the governor pauses low-acceptance requests and large batches).
  same       outputs identical to `off` (greedy; batched float arithmetic may legitimately
             diverge, this is informative, not a test).

    python -m bench.spec_decode                 # full run (~6-7 min on 2 quiet cores)
    python -m bench.spec_decode --quick         # smoke run (~2-3 min)

Noise: on a 2-core machine shared with other work, a 2-thread step stalls whenever one of its
threads is descheduled, and a speculating step (many small per-sequence ops) stalls more than a
plain decode step; `--threads 1` is steadier under contention. Compare runs' `load_avg_1min`.
    python -m bench.spec_decode --proposers off,ngram,self:24,draft:24,draft:8
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench import common
from bench.common import REPO_ROOT, fmt, log, machine_info, markdown_table, write_json
from bench.spec_decode_runs import run_scenario
from bench.spec_decode_workloads import CHAT, extractive_messages
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
from runtime.loading.loader import default_model_path, load_checkpoint
from runtime.spec_decode.make_draft import write_draft


# ---- main -------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer prompts, shorter outputs")
    ap.add_argument("--proposers", default="off,ngram,self:24,draft:24",
                    help="comma-separated: off, ngram, self:L, draft:N (N-layer draft) or "
                         "draft:PATH (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated (default: 1,8)")
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--spec-max-batch", type=int, default=8)
    ap.add_argument("--single-prompts", type=int, default=None,
                    help="prompts per workload at concurrency 1 (default 2)")
    ap.add_argument("--extract-tokens", type=int, default=None,
                    help="max_tokens for extractive prompts at concurrency 1 (default 160, "
                         "quick 64); half of it at higher concurrency")
    ap.add_argument("--chat-tokens", type=int, default=None,
                    help="max_tokens for chat prompts at concurrency 1 (default 128, quick 48); "
                         "half of it at higher concurrency")
    ap.add_argument("--model", default=None, help="target model (default: SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "spec_decode.json"))
    args = ap.parse_args(argv)

    threads = common.setup_threads(args.threads or os.cpu_count())
    singles = args.single_prompts or 2
    ext_tokens = args.extract_tokens or (64 if args.quick else 160)
    chat_tokens = args.chat_tokens or (48 if args.quick else 128)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    proposers = [p.strip() for p in args.proposers.split(",") if p.strip()]
    if "off" not in proposers:
        proposers.insert(0, "off")
    t_start = time.perf_counter()

    log(f"loading {args.model or default_model_path()} ...")
    ck = load_checkpoint(args.model or default_model_path())
    tok = ck.tokenizer

    def encode(msg: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))

    workloads = {"extractive": ([encode(m) for m in extractive_messages()], ext_tokens),
                 "chat": ([encode(m) for m in CHAT], chat_tokens)}
    for name, (ps, _) in workloads.items():
        lens = [len(p) for p in ps]
        log(f"{name}: {len(ps)} prompts, {min(lens)}-{max(lens)} prompt tokens")

    tmp = tempfile.mkdtemp(prefix="spec_bench_")
    engines: dict[str, LLMEngine] = {}
    draft_layers: dict[str, int] = {}
    try:
        for p in proposers:
            spec = p
            kind, _, arg = p.partition(":")
            if kind == "draft" and arg.isdigit():
                path = write_draft(ck, int(arg), os.path.join(tmp, f"draft{arg}"))
                spec, draft_layers[p] = f"draft:{path}", int(arg)
            cfg = EngineConfig(spec=spec, num_spec_tokens=args.num_spec_tokens,
                               spec_max_batch=args.spec_max_batch, kv_cache_bytes=256 << 20,
                               enable_prefix_caching=False)
            engines[p] = LLMEngine(ck, cfg)
            # warm-up: one short request alone, then a short batch (spec paths included)
            warm = [encode(f"Say hello number {i}.") for i in range(3)]
            engines[p].generate(warm[:1], SamplingParams(max_tokens=12, temperature=0.0))
            engines[p].generate(warm, SamplingParams(max_tokens=8, temperature=0.0))
            log(f"engine {p}: ready")

        results = []
        order = list(proposers)
        for wname, (prompts, full_tokens) in workloads.items():
            for conc in concurrencies:
                max_tokens = full_tokens if conc == 1 else max(8, full_tokens // 2)
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
                use = prompts[:singles] if conc == 1 else prompts[:conc]
                if len(use) < conc:
                    use = (use * conc)[:conc]
                scen = {}
                for p in order:
                    r = run_scenario(engines[p], use, params, conc, f"{wname}-{conc}-{p}")
                    scen[p] = r
                    log(f"{wname:10s} c={conc} {p:10s} {r['tokens']:5d} tok "
                        f"{r['wall_s']:6.1f}s {r['tok_s']:6.1f} tok/s "
                        f"accept {fmt(r['acceptance'])} len {fmt(r['mean_accepted_len'])}")
                order = order[1:] + order[:1]  # rotate who goes first
                base = scen["off"]
                for p in proposers:
                    r = scen[p]
                    r["speedup"] = r["tok_s"] / base["tok_s"]
                    r["decode_speedup"] = (r["decode_tok_s"] / base["decode_tok_s"]
                                           if r["decode_tok_s"] and base["decode_tok_s"]
                                           else None)
                    r["same_as_off"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
                    results.append({"workload": wname, "concurrency": conc, "proposer": p,
                                    "max_tokens": max_tokens,
                                    **{k: v for k, v in r.items() if k != "outputs"}})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    headers = ["workload", "conc", "proposer", "tokens", "wall s", "tok/s", "speedup",
               "decode/s", "dec. speedup", "accept", "mean len", "spec%", "same"]
    rows = [[r["workload"], r["concurrency"], r["proposer"], r["tokens"], fmt(r["wall_s"], 1),
             fmt(r["tok_s"], 1), fmt(r["speedup"]) + "x", fmt(r["decode_tok_s"], 1),
             fmt(r["decode_speedup"]) + "x" if r["decode_speedup"] else "n/a",
             fmt(r["acceptance"]), fmt(r["mean_accepted_len"]),
             fmt(100 * r["spec_fraction"], 0) if r["spec_fraction"] is not None else "n/a",
             f"{r['same_as_off']}/{r['requests']}"] for r in results]
    table = markdown_table(headers, rows)
    total_s = time.perf_counter() - t_start

    def pick(w, c, p):
        return next((r for r in results if r["workload"] == w and r["concurrency"] == c
                     and r["proposer"] == p), None)

    targets = {}
    ng = pick("extractive", 1, "ngram")
    if ng:
        targets["extractive_single_ngram_speedup"] = ng["speedup"]
        targets["extractive_single_ngram_ge_2x"] = ng["speedup"] >= 2.0
    chat_worst = [r["speedup"] for r in results if r["workload"] == "chat"
                  and r["proposer"] != "off"]
    if chat_worst:
        targets["chat_min_speedup"] = min(chat_worst)
        targets["chat_never_below_0.95x"] = min(chat_worst) >= 0.95

    print(f"## Speculative decoding ({'quick' if args.quick else 'full'} run, "
          f"{threads} threads, num_spec_tokens={args.num_spec_tokens}, "
          f"spec_max_batch={args.spec_max_batch}; max_tokens extractive {ext_tokens}, "
          f"chat {chat_tokens} at concurrency 1 ({singles} prompts in sequence), half that at "
          f"higher concurrency)\n")
    print(table)
    print()
    for k, v in targets.items():
        print(f"- {k}: {fmt(v) if isinstance(v, float) else v}")
    print(f"- total run time: {total_s:.0f} s")

    path = write_json(args.out, {
        "benchmark": "spec_decode", "quick": args.quick, "machine": machine_info(),
        "model": ck.source,
        "settings": {"proposers": proposers, "draft_layers": draft_layers,
                     "concurrency": concurrencies, "num_spec_tokens": args.num_spec_tokens,
                     "spec_max_batch": args.spec_max_batch, "single_prompts": singles,
                     "extractive_max_tokens": ext_tokens, "chat_max_tokens": chat_tokens,
                     "kv_cache_bytes": 256 << 20, "prefix_caching": False,
                     "prompt_tokens": {w: [len(p) for p in ps]
                                       for w, (ps, _) in workloads.items()}},
        "results": results, "targets": targets, "table": table, "total_s": total_s})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
