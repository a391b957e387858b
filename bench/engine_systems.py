"""The two systems bench/engine.py runs on a request mix: our engine stepping continuously as
requests arrive, and transformers' `generate` in static left-padded batches, with a shared result.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from bench import common
from bench.common import median, percentile
from bench.engine_workloads import Req


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
    from contract.sampling_params import SamplingParams

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
def load_hf(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """transformers on the same weights: a GGUF file (dequantized) or a Hugging Face folder."""
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    model.to(device)
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
        ids, mask = ids.to(model.device), mask.to(model.device)
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

