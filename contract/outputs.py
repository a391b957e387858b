"""What the engine hands back each step: per-request deltas and per-step statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (billed as hits)
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the N most likely alternatives


# JSON has no -inf: a prompt token the model rules out (logit -inf) is reported at this floor,
# the one OpenAI and the gateway use (gateway/openai/responses.py)
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored by the tokens before it (vLLM's prompt_logprobs)."""

    token_id: int
    logprob: float  # at least MIN_LOGPROB
    rank: int  # 1 + the number of vocabulary tokens strictly more likely
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (id, logprob), best first


@dataclass
class StepSample:
    """What one step sampled: new tokens per request (several when proposals were accepted),
    logprobs where asked, how many proposed tokens each speculating request rejected, and the
    prompt logprobs each gathering request got: (its first prompt position, entries)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """New tokens of one request since its last output. `usage` is current at every output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "rejected" or "error" once finished
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    timing: dict | None = None  # on the final output: arrival, scheduled, first_token, finished
    # once, on the first output with tokens: one entry per prompt token, None for the first
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # a request refused after admission ("rejected": its grammar did not compile): the
    # refusal the worker sends as a Rejected frame, {"message", "param", "kind"}
    error: dict | None = None


def wall_clock(monotonic_time: float | None) -> float | None:
    """A time.monotonic() reading as unix seconds (for spans that cross processes)."""
    if monotonic_time is None:
        return None
    return time.time() - (time.monotonic() - monotonic_time)


@dataclass(frozen=True)
class StepStats:
    num_requests: int  # requests that ran this step
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds_busy: float
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class EngineCounters:
    """Totals since start, for metrics."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    seconds_busy: float = 0.0
    spec_drafts: int = 0  # request-steps that verified proposals
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list = field(default_factory=list)
    overlapped_steps: int = 0  # steps launched before the previous one was read back
