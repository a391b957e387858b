"""One decode step in process, for each weight format side by side (the same engine code with
a feature on and off): `LLMEngine.step()` timed per step once every request is decoding.

For each batch size, B requests with 64-token prompts are added and prefilled, then the next
steps (all decode-only: the fused CPU layer's case) are timed; the formats alternate within
each batch size and each round, so a neighbour's burst hits both alike. Reports the median
step in ms, tokens/s, and each format's step as a ratio of the first format's.

    python -m bench.decode_step                          # int8 against auto (int4 on Q4_1)
    python -m bench.decode_step --formats int8,int4 --batches 1,8 --rounds 3
"""
from __future__ import annotations

import argparse
import sys
import time

from bench import common
from bench.common import log, markdown_table, median, write_json

PROMPT_TOKENS = 64


def step_times(engine, batch: int, steps: int, tag: str) -> list[float]:
    from contract.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    prompt = [(i * 37) % 1000 + 100 for i in range(PROMPT_TOKENS)]
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompt[i % 7:] + [i], params)  # distinct prompts
    sched = engine.scheduler
    while sched.waiting.peek() is not None or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()  # prefill (and a first decode for the early ones)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="int8,auto")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench/results/decode_step.json")
    a = p.parse_args(argv)
    threads = common.setup_threads(a.threads)
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.loading.loader import default_model_path, load_checkpoint

    load0 = common.machine_info()["load_avg_1min"]
    ck = load_checkpoint(default_model_path())
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    engines = {}
    for f in formats:
        log(f"[decode_step] building the {f} engine ...")
        engines[f] = LLMEngine(ck, EngineConfig(quantization=f, max_num_seqs=max(batches),
                                                max_num_batched_tokens=1024,
                                                kv_cache_bytes=1 << 30,
                                                enable_prefix_caching=False))
    served = {f: e.runner.model.quantization for f, e in engines.items()}
    times: dict[tuple[str, int], list[float]] = {}
    for b in batches:
        for r in range(a.rounds):
            for f in formats:
                log(f"[decode_step] batch {b}, round {r + 1}, {f}")
                times.setdefault((f, b), []).extend(
                    step_times(engines[f], b, a.steps, f"{f}-{b}-{r}"))
    rows, results = [], []
    for b in batches:
        base = median(times[(formats[0], b)])
        for f in formats:
            ms = median(times[(f, b)])
            rows.append([b, f"{f} ({served[f]})", f"{1e3 * ms:.1f}", f"{b / ms:.1f}",
                         f"{ms / base:.2f}"])
            results.append({"batch": b, "format": f, "served": served[f], "median_s": ms,
                            "steps_s": times[(f, b)]})
    info = common.machine_info()
    table = markdown_table(["batch", "weights", "ms / step", "tok/s",
                            f"step / {formats[0]}'s"], rows)
    print(f"\nMachine: {info['cpu']}, {threads} threads; 1-min load {load0} before, "
          f"{info['load_avg_1min']} after (includes this run)\n")
    print(table)
    write_json(a.out, {"benchmark": "decode_step", "args": vars(a), "machine": info,
                       "results": results, "table_markdown": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
