"""What the scheduler hands the model runner each step: plain, frozen data (ids and ints).

No `Request` objects cross this line. The runner looks a request up by id only where it
needs per-request state the step does not carry (sampling parameters, tokens before this
step), and keeps its own per-request state (seeded generators, a draft model's progress)
until the request's id comes back in `finished_request_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.kv.manager import KVTransfers


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: its tokens from `start_position` on, the block table
    their KV goes through, and the proposed tokens verified after them."""

    request_id: str
    start_position: int  # the request's num_computed_tokens when scheduled
    token_ids: tuple[int, ...]  # the sequence's own tokens that run this step
    block_ids: tuple[int, ...]  # the request's whole block table, in position order
    num_spec: int = 0  # proposed tokens verified after `token_ids` (their KV is written too)
    spec_token_ids: tuple[int, ...] = ()  # the proposals; a model drafter fills them in the runner
    samples: bool = False  # the step reaches the sequence's end, so a token is sampled

    @property
    def num_new_tokens(self) -> int:
        """Tokens this step computes, proposals included (what the token budget counts)."""
        return len(self.token_ids) + self.num_spec


@dataclass(frozen=True)
class SchedulerOutput:
    """Which tokens of which requests run this step, and what changed since the last one."""

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()  # left since the last step: drop their state
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
