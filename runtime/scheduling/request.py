"""Per-request state the scheduler and engine share: token ids, progress counters, status.

Blocks and block hashes are not here: the KV cache manager owns them (`kv.block_ids(id)`).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.outputs import PromptLogprob
from contract.sampling_params import SamplingParams
from runtime.spec_decode.governor import SpecState

if TYPE_CHECKING:
    from runtime.detokenizer import IncrementalDetokenizer
    from runtime.structured.matcher import GrammarState
    from runtime.structured.reasoning import ThinkBudget


# a sampled token still on the device: the step after it was scheduled before it was read
# (runtime/execution/overlap.py); the runner fills it in on the device, never the embedding's input
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # refused after admission: its grammar did not compile
    FINISHED_ERROR = "error"  # its grammar failed mid-output (a parser limit was hit)
    PARKED = "parked"  # out of the batch with its blocks: a prefill worker's, awaiting export

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "rejected", "error")


@dataclass
class Request:
    """One generation request.

    `num_computed_tokens` catches up with `num_tokens` (prompt plus output so far): a prefill
    chunk, a decode step and a recompute after preemption all follow that one rule. Only the
    scheduler (and the engine, for disaggregation) changes it.

    With overlapped steps a sampled token may still be on the device when the next step is
    planned: `num_placeholders` counts those. They are part of `num_tokens` (the scheduler
    plans over them) but not of `output_token_ids` (what was read back), nor of any block
    hash (only known tokens are hashed).
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
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the engine
    spec: SpecState = field(default_factory=SpecState)  # the speculation governor's record
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # prompt logprobs gathered so far, by prompt position (position 0 has none); None when
    # not asked for or already delivered. Set by the engine on admission.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    grammar: GrammarState | None = None  # a structured-output request's grammar (the engine's)
    think: ThinkBudget | None = None  # its reasoning budget (runtime/structured/reasoning.py)
    num_placeholders: int = 0  # sampled tokens not read back yet (overlapped steps)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output, placeholders included: what the scheduler plans over."""
        return self.num_known_tokens + self.num_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus the output read back so far (no placeholder)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def awaits_grammar(self) -> bool:
        """Its grammar is still compiling: it may run its prompt, but must not sample yet."""
        return self.grammar is not None and not self.grammar.is_ready

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Still gathering prompt logprobs: every prompt position must run through the model,
        so the prefix cache serves this request nothing (cached blocks skip compute)."""
        return self.prompt_logprobs is not None

    def add_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> None:
        """Entries for prompt positions `first`, `first` + 1, ...; those already held are
        skipped, so a chunk run again after preemption adds nothing twice."""
        held = self.prompt_logprobs
        if held is None:
            return
        if first > len(held):
            raise ValueError(f"prompt logprobs from position {first}, but only {len(held)} "
                             f"are held: a gap")
        held.extend(entries[len(held) - first:])

    def take_prompt_logprobs(self) -> list[PromptLogprob | None] | None:
        """The complete prompt logprobs, once: later calls (and recomputes after preemption)
        find nothing to gather or deliver."""
        held, self.prompt_logprobs = self.prompt_logprobs, None
        if held is not None and len(held) != self.num_prompt_tokens:
            raise ValueError(f"{len(held)} prompt logprobs for {self.num_prompt_tokens} tokens")
        return held

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1; PLACEHOLDER where a sampled token is unread."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        known = self.prompt_token_ids + self.output_token_ids
        return (known + [PLACEHOLDER] * self.num_placeholders)[start:end]

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: most urgent priority, then earliest arrival."""
        return (self.priority, self.arrival_time, self.request_id)
