"""Structured outputs, side by side in one run, on the real model (SmolLM2-135M, 49,152 tokens).

Sections:
  libraries    llguidance (used) against xgrammar (when installed) on this vocabulary: the
               tokenizer setup, compile time per schema cold and cached, and mask time per
               token while walking a valid instance (one thread each, mask then consume).
  engine       tokens/s of constrained against free requests at 1 and 32 concurrent. Free
               requests get exactly the constrained ones' output lengths (ignore_eos), so both
               do the same work but the masks; constrained runs with jump-forward off (the cost
               of masking alone) and on. The engine's own mask time per masked token and the
               compile cache (cold compile, cached submit) come from its counters.
  jump         jump-forward on against off on a structure-heavy schema (long fixed keys, the
               model picks only booleans and digits), greedy, one request at a time.

    python -m bench.structured            # about 3-6 minutes on 2 cores
    python -m bench.structured --quick    # fewer requests
Prints markdown tables and writes bench/results/structured.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench import common
from bench.common import REPO_ROOT, fmt, log, machine_info, markdown_table, median, write_json
from bench.structured_workloads import HEAVY, ORDER, SCHEMAS
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams, choice_seed
from contract.structured_spec import spec_key
from runtime.engine import LLMEngine
from runtime.loading.loader import default_model_path, load_checkpoint
from runtime.structured.compiler import JSON_OPTIONS, compile_grammar, make_lltokenizer


# ---- libraries ---------------------------------------------------------------------------
def _walk(fill, consume, tokens) -> list[float]:
    """Seconds of each mask computation along `tokens` (each consumed after its mask)."""
    times = []
    for t in tokens:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        if not consume(t):
            raise RuntimeError(f"token {t} refused")
    return times


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_library(library: str, tok, setup, compile_pair, walker) -> dict:
    """`setup()` -> context (timed as the tokenizer's setup); `compile_pair(ctx, schema)` ->
    (cold s, cached s, compiled); `walker(compiled)` -> (fill mask, consume token) of a new
    matcher. Each schema's instance is walked twice: the second walk shows the steady state
    once the first has built what the library builds lazily."""
    setup_s, ctx = _timed(setup)
    out: dict = {"library": library, "tokenizer_s": setup_s}
    for name, (schema, instance) in SCHEMAS.items():
        cold, cached, compiled = compile_pair(ctx, schema)
        tokens = tok.encode(json.dumps(instance))
        walks = [_walk(*walker(compiled), tokens) for _ in range(2)]
        out[name] = {"compile_cold_s": cold, "compile_cached_s": cached, "mask_s": walks[0],
                     "warm_mask_s": walks[1]}
    return out


def bench_llguidance(tok, vocab, eos) -> dict:
    import torch
    bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile_pair(lltok, schema):
        spec = {"type": "json", "schema": schema}
        cold, compiled = _timed(lambda: compile_grammar(lltok, spec))
        cache = {spec_key(spec): compiled}  # the engine's cache: a lookup by content
        cached, _ = _timed(lambda: cache[spec_key(spec)])
        return cold, cached, compiled

    def walker(compiled):
        m = compiled.new_matcher()
        return (lambda: m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4),
                m.consume_token)
    return measure_library("llguidance", tok, lambda: make_lltokenizer(tok, vocab, eos),
                           compile_pair, walker)


def bench_xgrammar(tok, vocab, eos) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    bits = xgr.allocate_token_bitmask(1, vocab)
    layout = dict(any_whitespace=False, separators=(JSON_OPTIONS["item_separator"],
                                                    JSON_OPTIONS["key_separator"]))

    def compile_pair(info, schema):
        compiler = xgr.GrammarCompiler(info, max_threads=common.num_cores())  # empty cache
        cold, _ = _timed(lambda: compiler.compile_json_schema(schema, **layout))
        cached, compiled = _timed(lambda: compiler.compile_json_schema(schema, **layout))
        return cold, cached, compiled

    def walker(compiled):
        m = xgr.GrammarMatcher(compiled)
        return (lambda: m.fill_next_token_bitmask(bits)), m.accept_token
    vocab_strings = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    return measure_library("xgrammar", tok, lambda: xgr.TokenizerInfo(
        vocab_strings, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=list(eos)),
        compile_pair, walker)


LIBRARY_HEADERS = ["library", "schema", "tokenizer ms", "compile cold ms", "cached us",
                   "mask us/token, first", "then", "median", "max", "tokens"]


def library_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        for name in SCHEMAS:
            s = r[name]
            rows.append([r["library"], name, fmt(r["tokenizer_s"] * 1e3, 0),
                         fmt(s["compile_cold_s"] * 1e3, 2), fmt(s["compile_cached_s"] * 1e6, 1),
                         fmt(sum(s["mask_s"]) / len(s["mask_s"]) * 1e6, 0),
                         fmt(sum(s["warm_mask_s"]) / len(s["warm_mask_s"]) * 1e6, 0),
                         fmt(median(s["warm_mask_s"]) * 1e6, 0),
                         fmt(max(s["warm_mask_s"]) * 1e6, 0), len(s["mask_s"])])
    return rows


# ---- engine ------------------------------------------------------------------------------
def run_batch(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> dict:
    """Submit all at once, step to completion: output lengths, wall time, steps."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(params))]
    for rid, p in zip(ids, params):
        engine.add_request(rid, prompt, p)
    lengths, texts, forced = dict.fromkeys(ids, 0), dict.fromkeys(ids, ""), 0
    masks = engine.structured.masks.stats
    mask_s, num_masks = masks.seconds, masks.num_rows
    start, cpu, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            lengths[o.request_id] += len(o.new_token_ids)
            texts[o.request_id] += o.new_text
            if o.finished:
                forced += (o.timing or {}).get("forced_tokens", 0)
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"lengths": [lengths[i] for i in ids], "texts": [texts[i] for i in ids],
            "wall_s": wall, "cpu_s": cpu, "steps": steps, "tokens": sum(lengths.values()),
            "forced": forced, "mask_s": masks.seconds - mask_s, "masks": masks.num_rows - num_masks}


MODES = ("constrained, jump off", "free", "constrained, jump on")


def mode_params(mode: str, seeds: list[int], lengths: list[int]) -> list[SamplingParams]:
    """Free requests get the constrained ones' output lengths: the same work but the masks."""
    spec = {"type": "json", "schema": ORDER}
    if mode == "free":
        return [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
                for s, n in zip(seeds, lengths)]
    return [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec,
                           jump_forward=mode.endswith("on")) for s in seeds]


def bench_engine(engine, prompt, concurrency: int, requests: int, rounds: int) -> list[dict]:
    """Every mode on the same seeded requests, `rounds` times, the order rotating each
    round so the machine's noise reaches every mode alike."""
    seeds = [choice_seed(1234, i) for i in range(requests)]
    groups = [seeds[i:i + concurrency] for i in range(0, requests, concurrency)]
    lengths = {i: run_batch(engine, prompt, mode_params(MODES[0], g, []))["lengths"]
               for i, g in enumerate(groups)}  # seeded: every later jump-off run repeats them
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            for i, group in enumerate(groups):
                runs[mode].append(run_batch(engine, prompt,
                                            mode_params(mode, group, lengths[i])))
    rows = []
    for name in ("free", *MODES[::2]):
        rs = runs[name]
        tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
        rows.append({"concurrency": concurrency, "mode": name, "requests": requests,
                     "rounds": rounds, "tokens": tokens, "wall_s": wall,
                     "tok_s": tokens / wall, "tok_cpu_s": tokens / sum(r["cpu_s"] for r in rs),
                     "steps": sum(r["steps"] for r in rs),
                     "forced": sum(r["forced"] for r in rs),
                     "mask_us_per_token": (1e6 * sum(r["mask_s"] for r in rs)
                                           / sum(r["masks"] for r in rs)
                                           if name != "free" else None)})
    for r in rows:
        r["vs_free"] = r["tok_s"] / rows[0]["tok_s"]
        r["cpu_vs_free"] = r["tok_cpu_s"] / rows[0]["tok_cpu_s"]
    return rows


def bench_jump(engine, prompt, reps: int) -> list[dict]:
    """Greedy, one request at a time, off and on alternating; the best of `reps` each."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(reps):
        for jump in (False, True):
            params = SamplingParams(max_tokens=300, temperature=0.0, jump_forward=jump,
                                    structured={"type": "json", "schema": HEAVY})
            runs[jump].append(run_batch(engine, prompt, [params]))
    rows = []
    for jump, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        rows.append({"jump_forward": jump, "tokens": best["tokens"], "steps": best["steps"],
                     "forced": best["forced"], "wall_s": best["wall_s"],
                     "tok_s": best["tokens"] / best["wall_s"],
                     "tok_cpu_s": best["tokens"] / best["cpu_s"], "text": best["texts"][0]})
    rows[1]["speedup"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    rows[1]["cpu_speedup"] = rows[1]["tok_cpu_s"] / rows[0]["tok_cpu_s"]
    rows[1]["same_text"] = rows[0]["text"] == rows[1]["text"]
    return rows


def engine_table(rows: list[dict]) -> str:
    return markdown_table(
        ["conc", "mode", "tokens", "forced", "steps", "tok/s", "vs free", "tok/cpu-s",
         "vs free (cpu)", "mask us/token"],
        [[r["concurrency"], r["mode"], r["tokens"], r["forced"], r["steps"], fmt(r["tok_s"], 1),
          fmt(r["vs_free"]) + "x", fmt(r["tok_cpu_s"], 1), fmt(r["cpu_vs_free"]) + "x",
          fmt(r["mask_us_per_token"], 0)] for r in rows])


def jump_table(rows: list[dict]) -> str:
    return markdown_table(
        ["jump-forward", "tokens", "forced", "steps", "wall s", "tok/s", "speedup",
         "speedup (cpu)", "same text"],
        [[r["jump_forward"], r["tokens"], r["forced"], r["steps"], fmt(r["wall_s"]),
          fmt(r["tok_s"], 1), fmt(r.get("speedup")), fmt(r.get("cpu_speedup")),
          r.get("same_text", "")] for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "structured.json"))
    args = ap.parse_args(argv)
    common.setup_threads(args.threads)
    log(f"machine: {machine_info()}")
    ck = load_checkpoint(default_model_path())
    tok, cfg = ck.tokenizer, ck.config
    libs = [bench_llguidance(tok, cfg.vocab_size, cfg.eos_token_ids)]
    libs += [xg] if (xg := bench_xgrammar(tok, cfg.vocab_size, cfg.eos_token_ids)) else []
    print(markdown_table(LIBRARY_HEADERS, library_rows(libs)), flush=True)

    engine = LLMEngine(ck, EngineConfig(kv_cache_bytes=512 << 20, max_num_batched_tokens=512))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                  "Write one example record as JSON."}]))
    run_batch(engine, prompt, [SamplingParams(max_tokens=8, structured={"type": "json"})])  # warm
    rounds = 1 if args.quick else 2
    rows = bench_engine(engine, prompt, 1, 2 if args.quick else 3, rounds)
    rows += bench_engine(engine, prompt, 32, 32, rounds)
    order = {"type": "json", "schema": ORDER}
    start = time.perf_counter()
    job = engine.structured.compiler.submit(spec_key(order), order)
    cache = {"compiles": engine.structured.compiler.num_compiles,
             "cache_hits": engine.structured.compiler.num_cache_hits,
             "cached_submit_us": (time.perf_counter() - start) * 1e6,
             "cold_compile_ms": (job.seconds or 0) * 1e3}
    print(engine_table(rows), "\n", cache, flush=True)
    jumps = bench_jump(engine, prompt, 1 if args.quick else 2)
    print(jump_table(jumps), flush=True)
    c32 = {r["mode"]: r for r in rows if r["concurrency"] == 32}["constrained, jump off"]
    targets = {"c32_constrained_vs_free": c32["vs_free"],
               "c32_constrained_vs_free_cpu": c32["cpu_vs_free"],
               "c32_at_least_0.9x": c32["vs_free"] >= 0.9,
               "jump_speedup": jumps[1]["speedup"],
               "jump_at_least_1.3x": jumps[1]["speedup"] >= 1.3}
    print(targets, f"load {os.getloadavg()[0]:.1f}")
    write_json(args.out, {"machine": machine_info(), "libraries": libs, "engine": rows,
                          "compile_cache": cache, "jump_forward": jumps, "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
