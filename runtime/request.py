"""Per-request state the scheduler and runner share: token ids, progress counters, block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Request:
    """One generation request.

    `num_computed_tokens` catches up with `num_tokens` (prompt plus output so far): a prefill
    chunk, a decode step and a recompute after preemption all follow that one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is more urgent, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, first admission
    blocks: list = field(default_factory=list)  # KVBlock objects, in position order
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    generator: object = None  # torch.Generator for seeded sampling (set by the runner)
    detokenizer: object = None  # IncrementalDetokenizer (set by the engine)
    block_hash_root: bytes | None = None  # prefix-cache chain root (model id + salt)
    block_hashes: list = field(default_factory=list)  # chained hashes of full blocks
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    spec_token_ids: list = field(default_factory=list)  # proposals being verified this step
    draft_written: int = 0  # positions [0, n) written to a draft model's own KV cache
    spec_state: dict = field(default_factory=lambda: {"rate": 1.0, "paused": 0,
                                                      "proposed": 0, "accepted": 0})
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def token_slice_with_spec(self, start: int, end: int) -> list[int]:
        """Tokens in [start, end), where positions past the sequence are the proposals."""
        n = self.num_tokens
        if end <= n:
            return self.token_slice(start, end)
        return (self.token_slice(start, n) if start < n else []) + \
            self.spec_token_ids[max(0, start - n):end - n]

    @property
    def spec_allowed(self) -> bool:
        return self.params.speculative

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: most urgent priority, then earliest arrival."""
        return (self.priority, self.arrival_time, self.request_id)
