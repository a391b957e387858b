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

    python bench/engine.py                 # full run (~15-20 min on 2 cores)
    python bench/engine.py --quick         # smoke run (~2-3 min)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (also puts the repo root on sys.path)
from common import fmt, log, markdown_table, median, percentile  # noqa: E402

import torch  # noqa: E402

# ---- workload ---------------------------------------------------------------------------
_SUBJECTS = ["The engineer", "A small team", "The old library", "Our new scheduler", "The river",
             "Every student", "The committee", "A curious child", "The city council",
             "The research group", "My neighbour", "The orchestra", "A quiet village",
             "The compiler", "The museum guide", "Each traveller", "The weather service",
             "The kitchen staff", "A stray cat", "The historian"]
_VERBS = ["described", "measured", "rebuilt", "questioned", "painted", "followed", "explained",
          "collected", "ignored", "celebrated", "reviewed", "planned", "tested", "remembered",
          "translated", "repaired", "organised", "watched", "compared", "discovered"]
_OBJECTS = ["the northern bridge", "a forgotten manuscript", "the morning schedule",
            "several broken clocks", "the long winter", "a set of careful notes",
            "the results of the experiment", "the harbour lights", "an unusual melody",
            "the budget for next year", "the mountain trail", "a cup of strong coffee",
            "the latest weather report", "the old train station", "a list of questions",
            "the garden behind the school", "three different maps", "the evening news"]
_TAILS = ["before the sun went down", "with great patience", "for the third time this week",
          "while everyone else was asleep", "in front of a small crowd", "without saying a word",
          "after a long discussion", "because nobody else would", "during the storm",
          "as the bells rang in the distance", "with a little help from friends",
          "to the surprise of the visitors", "in the corner of the room", "at dawn"]
_JOINS = ["Later,", "Meanwhile,", "However,", "As a result,", "In the end,", "Afterwards,",
          "At the same time,", "Surprisingly,"]


def make_text(rng: random.Random, num_sentences: int) -> str:
    """Plain English made of random, grammatical sentences (deterministic from `rng`)."""
    out = []
    for i in range(num_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.7:
            s += " " + rng.choice(_TAILS)
        if i and rng.random() < 0.25:
            s = rng.choice(_JOINS) + " " + s[0].lower() + s[1:]
        out.append(s + ".")
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the scenario starts


def make_requests(tokenizer, rng: random.Random, n: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], window_s: float, tag: str) -> list[Req]:
    """n requests: prompt token ids cut from real text at a random offset, drawn lengths,
    Poisson arrivals (exponential gaps with mean window_s / n; the first at 0)."""
    corpus = tokenizer.encode(make_text(rng, 1500))
    reqs, t = [], 0.0
    for i in range(n):
        plen = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - plen)
        olen = rng.randint(*output_range)
        if i:
            t += rng.expovariate(n / window_s) if window_s > 0 else 0.0
        reqs.append(Req(f"{tag}-{i}", corpus[start:start + plen], olen, t))
    return reqs


# ---- results ----------------------------------------------------------------------------
@dataclass
class RunResult:
    system: str
    wall_s: float  # first arrival -> last output token
    useful_tokens: int
    ttft_s: list[float]
    decode_tokens: int = 0  # output tokens after each request's first
    decode_s: float = 0.0  # summed over requests: first token -> last token (single only)
    step_rows: list = field(default_factory=list)  # [rows through layers, logit rows, repeats]
    busy_s: float = 0.0  # time spent inside engine.step() / generate()
    prompt_tokens_run: int = 0  # prompt tokens pushed through the model (padding included)
    steps: int = 0
    preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s else float("nan")

    def step_bound_s(self, prof: common.LinearProfile) -> float:
        """Linear layers alone over the steps this system actually ran."""
        return sum(k * (prof.layers(rows) + prof.lm_head(logits))
                   for rows, logits, k in self.step_rows)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("step_rows")
        d.update(tok_s=self.tok_s, decode_tok_s=self.decode_tok_s,
                 ttft_median_s=median(self.ttft_s), ttft_p90_s=percentile(self.ttft_s, 90))
        return d


# ---- our engine -------------------------------------------------------------------------
def run_ours(engine, reqs: list[Req]) -> RunResult:
    from runtime.sampling_params import SamplingParams

    pending = sorted(reqs, key=lambda r: r.arrival)
    by_id = {r.rid: r for r in reqs}
    first, last, count = {}, {}, {r.rid: 0 for r in reqs}
    step_rows, step_log, busy, steps, preempted, cached, i = [], [], 0.0, 0, 0, 0, 0
    t0 = time.perf_counter()
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(r.rid, r.prompt, SamplingParams(
                max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i].arrival - now))
            continue
        outputs, stats = engine.step()
        t = time.perf_counter() - t0
        for o in outputs:
            if o.new_token_ids:
                first.setdefault(o.request_id, t)
                last[o.request_id] = t
                count[o.request_id] += len(o.new_token_ids)
            if o.finished:
                cached += o.usage.cached_tokens
        steps += 1
        busy += stats.seconds_busy
        preempted += stats.num_preempted
        step_rows.append([stats.num_scheduled_tokens, len(outputs), 1])
        step_log.append([round(t, 4), stats.num_prefill_tokens, stats.num_decode_tokens,
                         round(stats.seconds_busy, 4)])
    wall = max(last.values())
    for rid, c in count.items():
        if c != by_id[rid].max_tokens:
            raise RuntimeError(f"{rid}: engine produced {c} tokens, expected "
                               f"{by_id[rid].max_tokens}")
    return RunResult(
        "ours", wall, sum(count.values()), [first[r.rid] - r.arrival for r in reqs],
        decode_tokens=sum(count.values()) - len(reqs),
        decode_s=sum(last[r.rid] - first[r.rid] for r in reqs), step_rows=step_rows,
        busy_s=busy, prompt_tokens_run=sum(len(r.prompt) for r in reqs) - cached, steps=steps,
        preemptions=preempted, extra={"prefix_cached_tokens": cached,
                                          "step_log_t_prefill_decode_s": step_log})


# ---- transformers -----------------------------------------------------------------------
def load_hf(path: str):
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    return model


class _FirstTokenTimer:
    """A `generate` streamer that records when the first generated token exists (its
    first `put` is the prompt) and when the last one does."""

    def __init__(self):
        self.calls, self.first, self.last = 0, None, None

    def put(self, value):
        self.calls += 1
        if self.calls >= 2:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            self.last = now

    def end(self):
        pass


def run_hf(model, reqs: list[Req], batch_size: int, pad_id: int) -> RunResult:
    """Static left-padded batches in arrival order; a batch starts when its last member has
    arrived and the previous batch has finished, and runs to its longest output."""
    from transformers.generation.streamers import BaseStreamer

    class Timer(_FirstTokenTimer, BaseStreamer):
        pass

    order = sorted(reqs, key=lambda r: r.arrival)
    ttft: dict[str, float] = {}
    step_rows, busy, steps, padded_prompt, decode_s, end = [], 0.0, 0, 0, 0.0, 0.0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        wait = max(r.arrival for r in batch) - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[j, width - len(r.prompt):] = 1
        new = max(r.max_tokens for r in batch)
        timer = Timer()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad_id,
                                 streamer=timer)
        end = time.perf_counter() - t0
        busy += time.perf_counter() - started
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers produced {out.shape[1] - width} tokens, "
                               f"expected {new}")
        for r in batch:
            ttft[r.rid] = timer.first - t0 - r.arrival
        decode_s += timer.last - timer.first
        steps += new
        padded_prompt += width * len(batch)
        # prefill: layers on every padded row, lm_head on the last row of each sequence;
        # then new-1 decode steps on the whole batch (finished rows keep running).
        step_rows.append([width * len(batch), len(batch), 1])
        step_rows.append([len(batch), len(batch), new - 1])
    useful = sum(r.max_tokens for r in reqs)
    return RunResult("transformers", end, useful, [ttft[r.rid] for r in reqs],
                     decode_tokens=useful - len(reqs), decode_s=decode_s,
                     step_rows=step_rows, busy_s=busy, prompt_tokens_run=padded_prompt,
                     steps=steps)


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


# ---- main -------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 short single request, one scenario of 8 small requests")
    p.add_argument("--scenarios", default=None,
                   help="comma list of 'single' and request counts (default single,32,64; "
                        "quick: single,8)")
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
    a = p.parse_args(argv)
    q = a.quick
    a.out = a.out or f"bench/results/engine{'-quick' if q else ''}.json"
    a.scenarios = [s.strip() for s in (a.scenarios or ("single,8" if q else "single,32,64"))
                   .split(",") if s.strip()]
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


def warm_up(engine, hf, reqs: list[Req], pad_id: int) -> None:
    run_ours(engine, reqs)
    if hf is not None:
        run_hf(hf, reqs, len(reqs), pad_id)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = common.setup_threads(args.threads)
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.loader import default_model_path, load_checkpoint

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
                                        seed=args.seed))
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
    weights = [w for layer in model.layers
               for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                         layer.down_weight)]
    sizes = ([1, 8, 32, 64, 256] if args.quick
             else [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512])
    measure = lambda: common.measure_linear(  # noqa: E731
        weights, model.lm_head, sizes, reps=2 if args.quick else 3,
        min_total_s=0.2 if args.quick else 1.0)
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
    lines = [f"Machine: {info['cpu']}, {threads} threads, torch {torch.__version__}; "
             f"1-min load average {fmt(load0)} at start, {fmt(info['load_avg_1min'])} at end "
             f"(includes this run)",
             f"  copy bandwidth:   {bw:.1f} GB/s copied = {2 * bw:.1f} GB/s of memory traffic "
             f"(read + write); read bandwidth (sum) {read_bw:.1f} GB/s",
             f"  float32 matmul:   {gflops:.1f} GFLOP/s",
             f"  linear layers alone (weights {prof.weight_bytes / 1e6:.0f} MB):"]
    for b in (1, 32, 64):
        t = prof.full(b)
        lines.append(f"    batch {b:>3}: {1e3 * t:7.1f} ms/step = {b / t:6.1f} tok/s ceiling "
                     f"({(prof.flops_per_token + prof.lm_head_flops_per_row) * b / t / 1e9:.1f}"
                     f" GFLOP/s, {prof.weight_bytes / t / 1e9:.1f} GB/s of weights)")
    lines.append(f"    prefill per token (large batch): {1e3 * prof.prefill_per_token():.2f} ms; "
                 f"measured before and after the scenarios, faster kept (max spread "
                 f"{100 * (prof.meta['max_spread'] - 1):.0f}%: large = noisy machine)")
    fl = prof.flops_per_token + prof.lm_head_flops_per_row
    if "single" in summary and "ours" in summary["single"]:
        s = summary["single"]["ours"]
        lines.append(f"  ours at one request: {s['tok_s']:.1f} tok/s decode = "
                     f"{100 * s['fraction_of_bound']:.0f}% of the batch-1 linear bound; "
                     f"weights read at {s['tok_s'] * prof.weight_bytes / 1e9:.1f} GB/s = "
                     f"{100 * s['tok_s'] * prof.weight_bytes / 1e9 / read_bw:.0f}% of the read "
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
        "table_markdown": table, "elapsed_s": elapsed})
    log(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
