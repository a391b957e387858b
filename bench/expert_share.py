"""The experts' share of a decode step, measured in process (issue 32): the engine built from a
GGUF as the gateway builds it, each MoE layer's block timed from the outside (nothing in
runtime/ changes), and `LLMEngine.step()` timed around it.

For each batch size B, B requests with distinct 64-token prompts are added and prefilled, then
`steps` decode-only steps are timed. In each step the time inside every MoE layer's block
(`SparseMoE.__call__`: router, routed experts, shared experts) is summed, and within it the
router (`SparseMoE.router`) and the routed experts (`SparseMoE.routed`: the grouping by
expert and each chosen expert's matrices); the shared experts are the rest of the block. The
expert computation is routed + shared. Also counted: the (layer, expert) pairs that ran in a
step, and from them the routed experts' weight bytes read per second of their time (against
the machine's read bandwidth: whether they are memory-bound). Each timer is a
`time.perf_counter()` pair around a call on the CPU, where every op has finished when the
call returns (on CUDA the figures would need a synchronize; this measures the CPU path the
comparison serves).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import fmt, markdown_table, median

PROMPT_TOKENS = 64
FIRST_PLAIN = 300  # past the synthetic vocabulary's specials, bytes and merges


@dataclass
class Clock:
    """Seconds inside each part of the MoE blocks since the last `reset()`."""

    block: float = 0.0
    router: float = 0.0
    routed: float = 0.0
    experts: int = 0  # (layer, expert) pairs that ran, i.e. experts' matrices read

    def reset(self) -> None:
        self.block = self.router = self.routed = 0.0
        self.experts = 0


@dataclass
class ShareResult:
    batch: int
    step_s: list[float] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    router_s: list[float] = field(default_factory=list)
    routed_s: list[float] = field(default_factory=list)
    experts: list[int] = field(default_factory=list)
    expert_bytes: int = 0  # one routed expert's three matrices in the file

    def share(self, part: str) -> float:
        """The part's seconds over the steps' seconds, all steps together."""
        return sum(getattr(self, part + "_s")) / sum(self.step_s)

    def summary(self) -> dict[str, float]:
        experts = [b - r for b, r in zip(self.block_s, self.router_s)]
        return {"batch": self.batch, "step_ms": 1e3 * median(self.step_s),
                "moe_block_share": self.share("block"), "router_share": self.share("router"),
                "routed_share": self.share("routed"),
                "shared_share": self.share("block") - self.share("router")
                - self.share("routed"),
                "expert_share": sum(experts) / sum(self.step_s),
                "experts_per_step": sum(self.experts) / len(self.experts),
                # the routed experts' weight bytes over their time: near the machine's read
                # bandwidth, the routed experts are memory-bound
                "routed_gb_s": sum(self.experts) * self.expert_bytes / sum(self.routed_s) / 1e9}


def _timed(fn, clock: Clock, part: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(clock, part, getattr(clock, part) + time.perf_counter() - start)
    return call


class _TimedBlock:
    """A MoE layer's block with its calls timed; every other attribute is the block's."""

    def __init__(self, moe, clock: Clock):
        self.moe, self.clock = moe, clock
        moe.router = _timed(moe.router, clock, "router")  # instance attributes: the block's
        routed = _timed(moe.routed, clock, "routed")  # own calls go through them

        def counted(x, weights, ids):
            clock.experts += int(ids.unique().numel())  # outside the routed timer
            return routed(x, weights, ids)
        moe.routed = counted

    def __call__(self, x):
        start = time.perf_counter()
        try:
            return self.moe(x)
        finally:
            self.clock.block += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.moe, name)


def hook(engine) -> Clock:
    """Time every MoE layer of `engine`'s model; returns the clock they add to."""
    clock = Clock()
    layers = [layer for layer in engine.runner.model.layers if layer.moe is not None]
    if not layers:
        raise ValueError("the model has no MoE layer to time")
    for layer in layers:
        layer.moe = _TimedBlock(layer.moe, clock)
    return clock


def measure_batch(engine, clock: Clock, batch: int, steps: int, tag: str,
                  bytes_per_expert: int = 0) -> ShareResult:
    from contract.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    plain = engine.model_config.vocab_size - FIRST_PLAIN  # ids of whole-word tokens
    prompt = [FIRST_PLAIN + (i * 37) % plain for i in range(PROMPT_TOKENS)]
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompt[i % 7:] + [i], params)  # distinct prompts
    sched = engine.scheduler
    while sched.waiting.peek() is not None or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()  # prefill (and a first decode for the early ones): not timed
    result = ShareResult(batch, expert_bytes=bytes_per_expert)
    for _ in range(steps):
        clock.reset()
        start = time.perf_counter()
        engine.step()
        result.step_s.append(time.perf_counter() - start)
        result.block_s.append(clock.block)
        result.router_s.append(clock.router)
        result.routed_s.append(clock.routed)
        result.experts.append(clock.experts)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def expert_bytes(path: str) -> int:
    """One routed expert's gate, up and down matrices in the file, in bytes (the first MoE
    layer's stacks over their expert count)."""
    import gguf

    stacks = [t for t in gguf.GGUFReader(path).tensors
              if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", t.name)]
    first = stacks[0].name.split(".")[1]
    layer = [t for t in stacks if t.name.split(".")[1] == first]
    return sum(int(t.n_bytes) for t in layer) // int(layer[0].shape[-1])


def measure(path: str, batches: list[int], steps: int, kv_bytes: int) -> list[ShareResult]:
    """The engine as the gateway builds it (its defaults, the comparison's KV room)."""
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine

    engine = LLMEngine.from_model_path(path, EngineConfig(kv_cache_bytes=kv_bytes,
                                                          max_num_seqs=max(batches)))
    try:
        clock = hook(engine)
        measure_batch(engine, clock, batches[0], 2, "warm")  # first calls build and page in
        size = expert_bytes(path)
        return [measure_batch(engine, clock, b, steps, f"b{b}", size) for b in batches]
    finally:
        engine.close()


def table(results: list[ShareResult]) -> str:
    rows = []
    for r in results:
        s = r.summary()
        rows.append([str(r.batch), fmt(s["step_ms"], 1), f"{100 * s['expert_share']:.0f}%",
                     f"{100 * s['routed_share']:.0f}%", f"{100 * s['shared_share']:.0f}%",
                     f"{100 * s['router_share']:.1f}%", f"{s['experts_per_step']:.0f}",
                     fmt(s["routed_gb_s"], 1)])
    return markdown_table(["sequences", "decode step, ms (median)", "experts (routed + shared)",
                           "routed experts", "shared experts", "router",
                           "experts run a step", "routed experts' GB/s"], rows)
