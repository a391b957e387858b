"""One scenario of bench/spec_decode.py on one engine: prompts submitted in batches and stepped to
completion, with wall and decode-only timings and the engine's speculation counters.
"""
from __future__ import annotations

import time

from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine


def snapshot(engine: LLMEngine) -> dict:
    c = engine.counters
    return {"drafts": c.spec_drafts, "draft_tokens": c.spec_draft_tokens,
            "accepted": c.spec_accepted_tokens, "per_pos": list(c.spec_accepted_per_pos)}


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str,
              acc: dict) -> list[list[int]]:
    """Submit `prompts` at once and step until all finish; adds timings to `acc`."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        n = 0
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
            n += len(o.new_token_ids)
        acc["slots"] += len(outputs)
        if stats.num_prefill_tokens == 0:
            acc["decode_s"] += stats.seconds_busy
            acc["decode_tokens"] += n
    acc["wall_s"] += time.perf_counter() - t0
    return [out[rid] for rid in ids]


def run_scenario(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                 concurrency: int, tag: str) -> dict:
    before = snapshot(engine)
    acc = {"wall_s": 0.0, "decode_s": 0.0, "decode_tokens": 0, "slots": 0}
    outputs: list[list[int]] = []
    for k in range(0, len(prompts), concurrency):
        outputs += run_batch(engine, prompts[k:k + concurrency], params, f"{tag}-{k}", acc)
    after = snapshot(engine)
    drafts = after["drafts"] - before["drafts"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
               for i, a in enumerate(after["per_pos"])]
    tokens = sum(len(o) for o in outputs)
    return {"requests": len(prompts), "tokens": tokens, "wall_s": acc["wall_s"],
            "tok_s": tokens / acc["wall_s"],
            "decode_tok_s": acc["decode_tokens"] / acc["decode_s"] if acc["decode_s"] else None,
            "decode_s": acc["decode_s"], "decode_tokens": acc["decode_tokens"],
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "accepted_per_pos": per_pos,
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_len": accepted / drafts + 1 if drafts else None,
            "spec_fraction": drafts / acc["slots"] if acc["slots"] else None,
            "outputs": outputs}

