"""Measuring prefix-cache runs for bench/prefix_cache.py: a batch stepped to completion with its
TTFTs and cache counters, the bound on possible hits, totals, and warmed-up engines.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import torch

from bench import common
from bench.common import log, median
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
from runtime.loading.loader import default_model_path, load_checkpoint


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta, tb = torch.tensor(a[:n]), torch.tensor(b[:n])
    diff = (ta != tb).nonzero()
    return int(diff[0]) if len(diff) else n


def possible_hits(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    best = max((common_prefix(prompt, s) for s in earlier), default=0)
    best = min(best, len(prompt) - 1)
    return best // block_size * block_size


class Tracker:
    """Everything submitted to an engine so far, for the `possible` bound."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.sequences: list[list[int]] = []

    def possible(self, prompts: list[list[int]]) -> list[int]:
        """Bound for a batch submitted at once, in submission order."""
        out, earlier = [], list(self.sequences)
        for p in prompts:
            out.append(possible_hits(p, earlier, self.block_size))
            earlier.append(p)
        return out

    def add(self, sequences: list[list[int]]) -> None:
        self.sequences.extend(sequences)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_batch(engine: LLMEngine, requests: list[tuple[str, list[int]]], max_tokens: int) -> dict:
    """Add every request now, step until all finish. Per-request TTFT, usage and outputs."""
    kv0 = dataclasses.replace(engine.kv.stats)
    pre0 = engine.counters.num_preemptions
    t_add: dict[str, float] = {}
    ttft: dict[str, float] = {}
    usage: dict = {}
    out_ids: dict[str, list[int]] = {rid: [] for rid, _ in requests}
    out_text: dict[str, str] = {rid: "" for rid, _ in requests}
    prefill = decode = steps = 0
    busy = 0.0
    t0 = time.perf_counter()
    for rid, ids in requests:
        t_add[rid] = time.perf_counter()
        engine.add_request(rid, ids, params(max_tokens))
    while engine.has_unfinished_requests():
        outputs, st = engine.step()
        now = time.perf_counter()
        steps += 1
        prefill += st.num_prefill_tokens
        decode += st.num_decode_tokens
        busy += st.seconds_busy
        for o in outputs:
            if o.request_id not in t_add:
                continue
            if o.request_id not in ttft and o.new_token_ids:
                ttft[o.request_id] = now - t_add[o.request_id]
            out_ids[o.request_id].extend(o.new_token_ids)
            out_text[o.request_id] += o.new_text
            usage[o.request_id] = o.usage
    wall = time.perf_counter() - t0
    kv1 = engine.kv.stats
    order = [rid for rid, _ in requests]
    return {
        "ids": order,
        "ttft_s": [ttft[r] for r in order],
        "prompt_tokens": [usage[r].prompt_tokens for r in order],
        "cached_tokens": [usage[r].cached_tokens for r in order],
        "output_ids": [out_ids[r] for r in order],
        "output_text": [out_text[r] for r in order],
        "step_prefill_tokens": prefill, "step_decode_tokens": decode, "steps": steps,
        "busy_s": busy, "wall_s": wall,
        "kv_queries": kv1.queries - kv0.queries, "kv_hits": kv1.hits - kv0.hits,
        "kv_disk_hits": kv1.disk_hits - kv0.disk_hits,
        "kv_evictions": kv1.evictions - kv0.evictions,
        "preemptions": engine.counters.num_preemptions - pre0,
    }


def summarise(runs: list[dict], possible: list[int] | None = None) -> dict:
    """Totals over one or more run_batch results (e.g. the turns of the multi-turn chat)."""
    ttft = [t for r in runs for t in r["ttft_s"]]
    prompt = sum(sum(r["prompt_tokens"]) for r in runs)
    cached = sum(sum(r["cached_tokens"]) for r in runs)
    s = {
        "requests": len(ttft), "median_ttft_s": median(ttft),
        "p90_ttft_s": common.percentile(ttft, 90), "max_ttft_s": max(ttft),
        "first_ttft_s": runs[0]["ttft_s"][0],
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "step_prefill_tokens": sum(r["step_prefill_tokens"] for r in runs),
        "steps": sum(r["steps"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
        "kv_queries": sum(r["kv_queries"] for r in runs),
        "kv_hits": sum(r["kv_hits"] for r in runs),
        "kv_hit_rate": (sum(r["kv_hits"] for r in runs) / sum(r["kv_queries"] for r in runs)
                        if sum(r["kv_queries"] for r in runs) else None),
        "preemptions": sum(r["preemptions"] for r in runs),
    }
    if possible is not None:
        s["possible_tokens"] = sum(possible)
        s["hit_of_possible"] = cached / sum(possible) if sum(possible) else None
    return s


class Bench:
    def __init__(self, args):
        self.args = args
        log(f"loading {args.model or default_model_path()}")
        self.ck = load_checkpoint(args.model or default_model_path())
        self.tok = self.ck.tokenizer
        self.warm_ids = self.tok.encode(
            "Unrelated warm-up text: seven green kites drifted over a quiet parking lot.")

    def config(self, cache: bool, disk_dir: str | None = None) -> EngineConfig:
        a = self.args
        return EngineConfig(enable_prefix_caching=cache, kv_cache_bytes=a.kv_mib << 20,
                            max_num_batched_tokens=a.max_num_batched_tokens,
                            max_num_seqs=a.max_num_seqs, disk_cache_dir=disk_dir)

    def engine(self, cache: bool, disk_dir: str | None = None) -> LLMEngine:
        gc.collect()
        eng = LLMEngine(self.ck, self.config(cache, disk_dir))
        run_batch(eng, [("warmup", self.warm_ids)], 2)  # shares no block with the workload
        return eng

    @staticmethod
    def release(engine: LLMEngine) -> None:
        if engine.disk_cache is not None:
            engine.disk_cache.close()
        del engine
        gc.collect()

