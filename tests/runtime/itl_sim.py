"""A closed-loop serving run on a simulated clock: the real scheduler and KV manager, a scripted
step cost, and clients that send their next request as soon as the last one ends (as `vllm
bench serve --max-concurrency` does). What it returns is what a streaming client measures:
inter-token gaps, times to first token, output tokens per second.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from numeric.percentiles import percentile
from runtime.kv.manager import KVCacheManager
from runtime.scheduling.itl_budget import ItlBudget
from runtime.scheduling.request import Request, RequestStatus
from runtime.scheduling.scheduler import Scheduler
from runtime.scheduling.step_cost import StepShape


def cpu_like_cost(shape: StepShape) -> float:
    """Seconds of a step on a 2-core CPU serving SmolLM2 (shaped after measured steps: 8 decode
    rows 20 ms, eight more prompt rows 15 ms more, 512 prompt rows about half a second):
    a fixed part, then rows at a falling marginal cost, and attention by key positions."""
    rows = shape.prefill_tokens + shape.decode_rows
    return 0.006 + 0.014 * (rows / 8) ** 0.85 + 2e-8 * shape.attention


@dataclass
class RunResult:
    itl: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    steps: list[StepShape] = field(default_factory=list)

    @property
    def itl_p50(self) -> float:
        return percentile(self.itl, 50)

    @property
    def itl_p99(self) -> float:
        return percentile(self.itl, 99)

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft, 50)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def closed_loop(itl: ItlBudget | None, cost: Callable[[StepShape], float] = cpu_like_cost,
                concurrency: int = 8, requests: int = 32, prompt_tokens: int = 256,
                output_tokens: int = 64, noise: float = 0.05, seed: int = 0,
                budget_tokens: int = 512) -> RunResult:
    """Serve `requests` random prompts, `concurrency` at a time, on a clock advanced by
    `cost` (times a seeded noise factor) per step; `itl` is the scheduler's budget."""
    rng = random.Random(seed)
    config = EngineConfig(block_size=16, max_num_batched_tokens=budget_tokens, num_blocks=4096)
    kv = KVCacheManager(4096, 16, enable_prefix_caching=True)
    sched = Scheduler(config, kv, max_model_len=4096)
    sched.itl = itl
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    now, sent, result = 0.0, 0, RunResult()
    sent_at: dict[str, float] = {}
    last_token: dict[str, float] = {}

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_tokens)]
        sched.add_request(Request(rid, prompt, params, arrival_time=now))
        sent_at[rid] = now
        sent += 1

    for _ in range(min(concurrency, requests)):
        send()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        shape = StepShape.of(out)
        seconds = cost(shape) * (1.0 + noise * rng.uniform(-1.0, 1.0))
        now += seconds
        result.steps.append(shape)
        sched.observe_step(out, seconds)
        for request in sched.update_computed(out):
            request.output_token_ids.append(7)
            rid = request.request_id
            if rid in last_token:
                result.itl.append(now - last_token[rid])
            else:
                result.ttft.append(now - sent_at[rid])
            last_token[rid] = now
            result.output_tokens += 1
            if request.num_output_tokens >= output_tokens:
                sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
                if sent < requests:
                    send()
    result.seconds = now
    return result
