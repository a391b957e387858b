"""Speculation that never costs: one stream, speculation off against n-gram proposals under
the governor, on three prompt classes, side by side in one run.

Classes (chat-template user messages, greedy, `--max-tokens` caps each answer):
  copy     "repeat this paragraph exactly": the answer is text of the prompt, the case where
           prompt lookup pays most.
  rewrite  "rewrite this code with snake_case names": the answer copies most of the prompt
           but changes many tokens, so long proposals are often rejected.
  chat     ordinary open questions: proposals come only from the answer's own repetitions.

Each class runs its prompts one after another (one stream) on each engine, the engines taking
turns first per repetition (`--repeats`), so the machine's noise reaches both alike; each
engine is warmed up first (and its governor keeps what it measured across classes, as a
server would). Reported per class: tokens/s (tokens / wall time from submission to finish,
prefill included) and the ratio n-gram / off, the governor's share of request-steps that
speculated, its acceptance and its probes. Target: the ratio at least 1.0 in every class.

    python -m bench.spec_governor                       # SmolLM2 (the default model)
    python -m bench.spec_governor --prompts 1 --max-tokens 16 --repeats 1   # smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import common
from bench.common import REPO_ROOT, fmt, log, machine_info, markdown_table, write_json
from bench.spec_decode_runs import run_scenario
from bench.spec_decode_workloads import CHAT, CODE, PROSE
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
from runtime.loading.loader import default_model_path, load_checkpoint


def class_messages() -> dict[str, list[str]]:
    return {
        "copy": ["Repeat the following paragraph exactly, word for word:\n\n" + p
                 for p in PROSE],
        "rewrite": ["Rewrite the following Python code with the variable and function names "
                    "in snake_case, otherwise unchanged:\n\n" + c for c in CODE],
        "chat": list(CHAT),
    }


def make_engine(checkpoint, spec: str, num_spec_tokens: int, encode,
                thread_policy: str = "adaptive") -> LLMEngine:
    engine = LLMEngine(checkpoint, EngineConfig(
        spec=spec, num_spec_tokens=num_spec_tokens, spec_max_batch=1,
        kv_cache_bytes=256 << 20, enable_prefix_caching=False, thread_policy=thread_policy))
    warm = [encode(f"Say hello number {i}.") for i in range(2)]
    for p in warm:  # one stream, as measured
        engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0))
    return engine


def run_class(engines: dict[str, LLMEngine], prompts, params, repeats: int, name: str) -> dict:
    """Per engine: the median tokens/s over `repeats` runs of the class's prompts, and the
    last run's speculation counters."""
    runs: dict[str, list[dict]] = {p: [] for p in engines}
    order = list(engines)
    for rep in range(repeats):
        for p in order:
            runs[p].append(run_scenario(engines[p], prompts, params, 1, f"{name}-{rep}-{p}"))
        order = order[1:] + order[:1]
    out = {}
    for p, rs in runs.items():
        last = rs[-1]
        out[p] = {"tok_s": statistics.median(r["tok_s"] for r in rs),
                  "tok_s_runs": [r["tok_s"] for r in rs], "tokens": last["tokens"],
                  "acceptance": last["acceptance"], "spec_fraction": last["spec_fraction"],
                  "outputs": last["outputs"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per class (default 3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs per class and engine")
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--thread-policy", default="adaptive", choices=("adaptive", "fixed"),
                    help="the engines' thread policy: adaptive (as served) or fixed (steadier "
                         "on a shared machine: each engine's own thread trials may settle "
                         "differently, which is no effect of speculation)")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "spec_governor.json"))
    args = ap.parse_args(argv)

    threads = common.setup_threads(args.threads or os.cpu_count())
    t_start = time.perf_counter()
    log(f"loading {args.model or default_model_path()} ...")
    ck = load_checkpoint(args.model or default_model_path())
    tok = ck.tokenizer

    def encode(msg: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))

    engines = {p: make_engine(ck, p, args.num_spec_tokens, encode, args.thread_policy)
               for p in ("off", "ngram")}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    for name, messages in class_messages().items():
        prompts = [encode(m) for m in messages[:args.prompts]]
        probes = engines["ngram"].scheduler.governor.num_probes
        r = run_class(engines, prompts, params, args.repeats, name)
        off, on = r["off"], r["ngram"]
        row = {"class": name, "prompts": len(prompts), "off_tok_s": off["tok_s"],
               "ngram_tok_s": on["tok_s"], "ratio": on["tok_s"] / off["tok_s"],
               "off_runs": off["tok_s_runs"], "ngram_runs": on["tok_s_runs"],
               "acceptance": on["acceptance"], "spec_fraction": on["spec_fraction"],
               "probes": engines["ngram"].scheduler.governor.num_probes - probes,
               "same": sum(a == b for a, b in zip(on["outputs"], off["outputs"]))}
        results.append(row)
        log(f"{name:8s} off {row['off_tok_s']:6.1f} tok/s  ngram {row['ngram_tok_s']:6.1f} "
            f"tok/s  {row['ratio']:.2f}x  spec% {fmt(100 * (row['spec_fraction'] or 0), 0)}")

    headers = ["class", "off tok/s", "ngram+governor tok/s", "ratio", "spec%", "accept",
               "probes", "same"]
    rows = [[r["class"], fmt(r["off_tok_s"], 1), fmt(r["ngram_tok_s"], 1),
             fmt(r["ratio"]) + "x", fmt(100 * (r["spec_fraction"] or 0), 0),
             fmt(r["acceptance"]), r["probes"], f"{r['same']}/{r['prompts']}"]
            for r in results]
    table = markdown_table(headers, rows)
    worst = min(r["ratio"] for r in results)
    targets = {"min_ratio": worst, "never_below_1.0x": worst >= 1.0}
    print(f"## Speculation under the governor, one stream ({threads} threads, "
          f"num_spec_tokens={args.num_spec_tokens}, max_tokens {args.max_tokens}, "
          f"{args.prompts} prompts per class, median of {args.repeats} runs)\n")
    print(table)
    print()
    for k, v in targets.items():
        print(f"- {k}: {fmt(v) if isinstance(v, float) else v}")
    total_s = time.perf_counter() - t_start
    print(f"- total run time: {total_s:.0f} s")
    path = write_json(args.out, {
        "benchmark": "spec_governor", "machine": machine_info(), "model": ck.source,
        "settings": vars(args), "results": results, "targets": targets, "table": table,
        "total_s": total_s})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
