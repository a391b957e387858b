"""Prefix caching off against on, side by side in one run, on the real model.

Scenarios (greedy, EOS ignored, so both modes run exactly the same tokens):
  shared report  one long document (default 1,500 tokens, invented sentences) in a chat-template
                 user message, followed by N (default 40) different short questions, one request
                 per question, all arriving at once (concurrent users). Two variants:
                   concurrent  the cache starts empty: the first request's chunks must be
                               computed (and their blocks registered) before the others can hit;
                   warm        the document was sent once before (one priming request with
                               another question), then the N questions arrive at once.
                 The cache-off reference is one run of the same N requests: with the cache off
                 a priming request changes nothing, so it serves both variants.
  multi-turn     C conversations (default 10) of T turns (default 8), interleaved: turn t of every
                 conversation arrives at once; each turn re-sends the whole history (chat
                 template, the model's previous answers as assistant messages) plus a new user
                 message.
  warm restart   engine A with a disk tier serves the document once and closes (its cached
                 blocks go to disk); a fresh engine B on the same folder serves the document with
                 a new question; a fresh engine C without a disk tier (cold) serves the same
                 request. First-request time to first token, B against C (median of repeats).

Definitions:
  TTFT       time from add_request to the step that returns the request's first token.
  computed   prompt tokens actually run through the model: sum(prompt_tokens - cached_tokens)
             from each request's Usage; cross-checked against the sum of StepStats'
             num_prefill_tokens (which counts every scheduled chunk longer than one token, so it
             also includes recomputation after preemption, and a one-token chunk is counted as a
             decode).
  possible   prompt tokens that could possibly hit: for each request, the longest common prefix
             of its prompt with any sequence submitted before it (earlier prompts plus the
             output tokens whose KV was computed), capped at prompt length - 1 (the last prompt
             token is always computed) and rounded down to a multiple of the block size (only
             full blocks are cached). For the shared report this is, per request after the
             first, the template header plus the document, block-aligned.
  hit/poss.  cached tokens (sum of Usage.cached_tokens) / possible. The engine's own
             PrefixCacheStats (queries, hits) over the same requests are reported too.

Every engine gets one short unrelated warm-up request before it is measured (it shares no
block with the workload), so one-time costs are not charged to either mode.

    python -m bench.prefix_cache                # full run (~10-15 min on 2 cores)
    python -m bench.prefix_cache --quick        # smoke run (~1-2 min)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench import common
from bench.common import fmt, log, markdown_table, median
from bench.prefix_cache_runs import (
    Bench,
    Tracker,
    common_prefix,
    possible_hits,
    run_batch,
    summarise,
)
from bench.prefix_cache_workloads import (
    conversation_user_message,
    make_document_ids,
    make_questions,
    shared_report_prompts,
)


# ---- scenarios --------------------------------------------------------------------------
def shared_report(b: Bench, a) -> dict:
    doc_ids = make_document_ids(b.tok, a.doc_tokens, a.seed)
    questions = make_questions(a.questions + 1, a.seed + 1)
    prompts = shared_report_prompts(b.tok, doc_ids, questions)
    prime, prompts = prompts[0], prompts[1:]
    bs = b.config(True).block_size
    reqs = [(f"q{i}", p) for i, p in enumerate(prompts)]
    # shared prefix of all prompts (template header + document)
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:]) if len(prompts) > 1 else 0
    res = {"doc_tokens": len(doc_ids), "questions": len(prompts),
           "shared_prefix_tokens": shared,
           "prompt_tokens_each": [len(p) for p in prompts],
           "question_tokens_each": [len(p) - shared for p in prompts]}

    # cache off: one run serves both variants (a priming request changes nothing with it off)
    log(f"shared report: cache off, {len(prompts)} requests x {len(prompts[0])} tokens")
    eng = b.engine(False)
    off = run_batch(eng, reqs, a.max_tokens)
    b.release(eng)
    res["off"] = summarise([off])
    res["off"]["possible_tokens"] = sum(Tracker(bs).possible(prompts))
    res["off_runs"] = off

    log("shared report: cache on, concurrent (cold cache)")
    eng = b.engine(True)
    tr = Tracker(bs)
    poss = tr.possible(prompts)
    on = run_batch(eng, reqs, a.max_tokens)
    b.release(eng)
    res["on_concurrent"] = summarise([on], poss)
    res["on_concurrent"]["possible_each"] = poss
    res["on_concurrent_runs"] = on

    log("shared report: cache on, warm (document sent once before)")
    eng = b.engine(True)
    tr = Tracker(bs)
    primed = run_batch(eng, [("prime", prime)], a.max_tokens)
    tr.add([prime + primed["output_ids"][0][:-1]])
    poss = tr.possible(prompts)
    on = run_batch(eng, reqs, a.max_tokens)
    b.release(eng)
    res["on_warm"] = summarise([on], poss)
    res["on_warm"]["possible_each"] = poss
    res["on_warm"]["priming_ttft_s"] = primed["ttft_s"][0]
    res["on_warm_runs"] = on

    for v in ("on_concurrent", "on_warm"):
        res[v]["median_ttft_speedup"] = res["off"]["median_ttft_s"] / res[v]["median_ttft_s"]
    # outputs must not depend on the cache (greedy): a cheap end-to-end correctness check
    res["outputs_equal_off_on_concurrent"] = off["output_ids"] == res["on_concurrent_runs"][
        "output_ids"]
    res["outputs_equal_off_on_warm"] = off["output_ids"] == res["on_warm_runs"]["output_ids"]
    return res


def multi_turn(b: Bench, a, cache: bool) -> dict:
    eng = b.engine(cache)
    bs = eng.config.block_size
    tr = Tracker(bs)
    histories = [[] for _ in range(a.conversations)]
    runs, possible = [], []
    for turn in range(a.turns):
        reqs = []
        for c, h in enumerate(histories):
            h.append({"role": "user", "content": conversation_user_message(c, turn, a.seed)})
            reqs.append((f"c{c}t{turn}", b.tok.encode(b.tok.apply_chat_template(h))))
        possible += tr.possible([p for _, p in reqs])
        r = run_batch(eng, reqs, a.chat_tokens)
        tr.add([p + o[:-1] for (_, p), o in zip(reqs, r["output_ids"])])
        for h, text in zip(histories, r["output_text"]):
            h.append({"role": "assistant", "content": text.strip() or "..."})
        runs.append(r)
        log(f"  turn {turn + 1}/{a.turns}: prompts {sum(r['prompt_tokens'])} tokens, "
            f"cached {sum(r['cached_tokens'])}, median TTFT {median(r['ttft_s']):.2f} s")
    b.release(eng)
    s = summarise(runs, possible if cache else None)
    if not cache:
        s["possible_tokens"] = sum(possible)
    s["per_turn"] = [{"prompt_tokens": sum(r["prompt_tokens"]),
                      "cached_tokens": sum(r["cached_tokens"]),
                      "median_ttft_s": median(r["ttft_s"])} for r in runs]
    s["output_ids"] = [r["output_ids"] for r in runs]
    return s


def warm_restart(b: Bench, a) -> dict:
    doc_ids = make_document_ids(b.tok, a.doc_tokens, a.seed)
    q = make_questions(2, a.seed + 7)
    first, second = shared_report_prompts(b.tok, doc_ids, q)
    reps = []
    for rep in range(a.restart_reps):
        log(f"warm restart: repeat {rep + 1}/{a.restart_reps}")
        with tempfile.TemporaryDirectory(prefix="kv-disk-") as d:
            eng = b.engine(True, d)  # A: serve the document once, close (persist to disk)
            ra = run_batch(eng, [("a", first)], a.max_tokens)
            eng.close()
            writes = eng.disk_cache.stats.writes
            files = len([f for f in os.listdir(d)])
            b.release(eng)
            eng = b.engine(True, d)  # B: restarted on the same folder
            reads0 = eng.disk_cache.stats.reads  # (the warm-up request's own block is on disk)
            rb = run_batch(eng, [("b", second)], a.max_tokens)
            reads = eng.disk_cache.stats.reads - reads0
            b.release(eng)
        eng = b.engine(True)  # C: cold start, no disk tier
        rc = run_batch(eng, [("c", second)], a.max_tokens)
        b.release(eng)
        reps.append({"a_ttft_s": ra["ttft_s"][0], "disk_blocks_written": writes,
                     "disk_files": files, "b_ttft_s": rb["ttft_s"][0],
                     "b_cached_tokens": rb["cached_tokens"][0],
                     "b_disk_hit_tokens": rb["kv_disk_hits"], "b_disk_blocks_read": reads,
                     "c_ttft_s": rc["ttft_s"][0], "c_cached_tokens": rc["cached_tokens"][0],
                     "prompt_tokens": rb["prompt_tokens"][0],
                     "outputs_equal": rb["output_ids"] == rc["output_ids"]})
    warm = median([r["b_ttft_s"] for r in reps])
    cold = median([r["c_ttft_s"] for r in reps])
    return {"reps": reps, "warm_ttft_s": warm, "cold_ttft_s": cold, "speedup": cold / warm,
            "possible_tokens": possible_hits(second, [first], b.config(True).block_size)}


# ---- main -------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller: 500-token document, 8 questions, 3 conversations x 3 turns")
    p.add_argument("--out", default=None,
                   help="JSON results path (default bench/results/prefix_cache.json)")
    p.add_argument("--model", default=None, help="GGUF path (default: the shipped SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc-tokens", type=int, default=None, help="default 1500 (quick: 500)")
    p.add_argument("--questions", type=int, default=None, help="default 40 (quick: 8)")
    p.add_argument("--conversations", type=int, default=None, help="default 10 (quick: 3)")
    p.add_argument("--turns", type=int, default=None, help="default 8 (quick: 3)")
    p.add_argument("--max-tokens", type=int, default=8,
                   help="output tokens per shared-report / restart request")
    p.add_argument("--chat-tokens", type=int, default=None,
                   help="output tokens per chat turn (default 16; quick: 8)")
    p.add_argument("--restart-reps", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--kv-mib", type=int, default=512, help="KV pool budget per engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--scenarios", default="shared,chat,restart",
                   help="comma-separated subset of shared,chat,restart")
    a = p.parse_args(argv)
    q = a.quick
    a.doc_tokens = a.doc_tokens or (500 if q else 1500)
    a.questions = a.questions or (8 if q else 40)
    a.conversations = a.conversations or (3 if q else 10)
    a.turns = a.turns or (3 if q else 8)
    a.chat_tokens = a.chat_tokens or (8 if q else 16)
    a.restart_reps = a.restart_reps or (1 if q else 3)
    a.out = a.out or os.path.join(common.REPO_ROOT, "bench", "results", "prefix_cache.json")
    scenarios = set(a.scenarios.split(","))

    threads = common.setup_threads(a.threads or os.cpu_count())
    log(f"torch threads: {threads}")
    b = Bench(a)
    results: dict = {"args": vars(a), "machine": common.machine_info()}
    t0 = time.perf_counter()

    if "shared" in scenarios:
        results["shared_report"] = shared_report(b, a)
    if "chat" in scenarios:
        log(f"multi-turn: cache off, {a.conversations} conversations x {a.turns} turns")
        off = multi_turn(b, a, False)
        log("multi-turn: cache on")
        on = multi_turn(b, a, True)
        results["multi_turn"] = {"off": off, "on": on,
                                 "median_ttft_speedup": off["median_ttft_s"] / on["median_ttft_s"],
                                 "outputs_equal": off.pop("output_ids") == on.pop("output_ids")}
    if "restart" in scenarios:
        results["warm_restart"] = warm_restart(b, a)
    results["total_wall_s"] = time.perf_counter() - t0

    # ---- report -------------------------------------------------------------------------
    rows = []

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    if "shared_report" in results:
        sr = results["shared_report"]
        label = f"shared report ({sr['doc_tokens']}-tok doc, {sr['questions']} questions)"
        for name, key in (("off", "off"), ("on, cold cache, concurrent", "on_concurrent"),
                          ("on, doc sent before", "on_warm")):
            s = sr[key]
            rows.append([label, name, fmt(s["median_ttft_s"]), fmt(s["p90_ttft_s"]),
                         s["prompt_tokens"], s["computed_tokens"], s["step_prefill_tokens"],
                         s["cached_tokens"], s["possible_tokens"],
                         pct(s.get("hit_of_possible")) if key != "off" else "0.0%",
                         pct(s["kv_hit_rate"]) if key != "off" else "n/a",
                         "1.00x" if key == "off" else f"{s['median_ttft_speedup']:.2f}x"])
    if "multi_turn" in results:
        mt = results["multi_turn"]
        label = f"multi-turn ({a.conversations} conv x {a.turns} turns)"
        for name in ("off", "on"):
            s = mt[name]
            rows.append([label, name, fmt(s["median_ttft_s"]), fmt(s["p90_ttft_s"]),
                         s["prompt_tokens"], s["computed_tokens"], s["step_prefill_tokens"],
                         s["cached_tokens"], s["possible_tokens"],
                         pct(s.get("hit_of_possible")) if name == "on" else "0.0%",
                         pct(s["kv_hit_rate"]) if name == "on" else "n/a",
                         "1.00x" if name == "off" else f"{mt['median_ttft_speedup']:.2f}x"])
    if "warm_restart" in results:
        wr = results["warm_restart"]
        r0 = wr["reps"][0]
        label = f"warm restart (first request, median of {len(wr['reps'])})"
        rows.append([label, "cold start (no disk tier)", fmt(wr["cold_ttft_s"]), "",
                     r0["prompt_tokens"], r0["prompt_tokens"] - r0["c_cached_tokens"], "",
                     r0["c_cached_tokens"], wr["possible_tokens"], "", "", "1.00x"])
        rows.append([label, "restart with disk tier", fmt(wr["warm_ttft_s"]), "",
                     r0["prompt_tokens"], r0["prompt_tokens"] - r0["b_cached_tokens"], "",
                     r0["b_cached_tokens"], wr["possible_tokens"],
                     pct(r0["b_cached_tokens"] / wr["possible_tokens"])
                     if wr["possible_tokens"] else "n/a", "", f"{wr['speedup']:.2f}x"])
    table = markdown_table(
        ["scenario", "prefix cache", "median TTFT s", "p90 TTFT s", "prompt tok",
         "computed tok", "prefill tok (steps)", "cached tok", "possible tok", "hit / possible",
         "engine hit rate", "TTFT speedup"], rows)
    print(table)
    print()
    notes = []
    if "shared_report" in results:
        sr = results["shared_report"]
        for key, name in (("on_concurrent", "cold cache, concurrent"),
                          ("on_warm", "doc sent before")):
            s = sr[key]
            ok_t = s["median_ttft_speedup"] >= 10
            ok_h = (s["hit_of_possible"] or 0) >= 0.95
            notes.append(f"- shared report, {name}: median TTFT {s['median_ttft_speedup']:.1f}x "
                         f"lower (target >= 10x: {'met' if ok_t else 'NOT met'}); hits "
                         f"{s['cached_tokens']}/{s['possible_tokens']} possible tokens = "
                         f"{pct(s['hit_of_possible'])} (target >= 95%: "
                         f"{'met' if ok_h else 'NOT met'}); preemptions {s['preemptions']}.")
        notes.append(f"- greedy outputs identical off vs on: concurrent "
                     f"{sr['outputs_equal_off_on_concurrent']}, warm "
                     f"{sr['outputs_equal_off_on_warm']}.")
    if "multi_turn" in results:
        notes.append(f"- multi-turn greedy outputs identical off vs on: "
                     f"{results['multi_turn']['outputs_equal']}.")
    if "warm_restart" in results:
        wr = results["warm_restart"]
        notes.append(f"- warm restart: {r0['disk_blocks_written']} blocks written by A, "
                     f"{r0['b_disk_blocks_read']} read back by B "
                     f"({r0['b_disk_hit_tokens']} tokens); outputs identical B vs C: "
                     f"{all(r['outputs_equal'] for r in wr['reps'])}.")
    notes.append("- computed tok = sum(prompt_tokens - cached_tokens); prefill tok (steps) = "
                 "sum of StepStats.num_prefill_tokens; possible tok = per request, the longest "
                 "common prefix with anything submitted earlier, capped at prompt length - 1, "
                 "rounded down to whole 16-token blocks.")
    notes.append(f"- total wall time {results['total_wall_s']:.0f} s, "
                 f"{threads} torch threads, load average "
                 f"{results['machine']['load_avg_1min']}.")
    print("\n".join(notes))
    results["table_markdown"] = table
    results["notes"] = notes
    out = common.write_json(a.out, results)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
