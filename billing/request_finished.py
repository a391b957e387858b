"""The one event a finished request leaves behind, whatever ended it.

The accounting builds it once, when the request settles (before its client's stream sees the
end), and hands the same frozen record to every subscriber: the ledger row, the Prometheus
metrics, the trace and the live feed. So a client that disconnected is counted in the token
metrics exactly as it is billed, and no subscriber can change what another one sees.
"""
from __future__ import annotations

from dataclasses import dataclass

from billing.pricing import Cost

FAILED = ("error", "rejected")


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str
    tenant: str
    key_name: str
    model: str
    priority: int
    status: str  # ok | cancelled | error | rejected
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: Cost
    price_multiplier: float
    finish_reasons: tuple[str, ...]  # why each choice that finished ended, by choice index
    enqueued_at: float  # monotonic, like the three below
    dispatched_at: float | None
    first_token_at: float | None  # the first token reached the gateway
    settled_at: float
    worker_index: int | None
    device: str | None
    trace_headers: dict | None  # the client's traceparent / tracestate
    worker_timing: dict | None  # wall-clock times the worker reported
    tier: str = "online"  # billing.pricing.TIERS: "batch" for a line of a Batch API job
    batch_id: str | None = None  # that job's id

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def reasons_text(self) -> str | None:
        """The distinct finish reasons, sorted and comma-joined (None: no choice finished)."""
        return ",".join(sorted(set(self.finish_reasons))) or None

    @property
    def failed(self) -> bool:
        return self.status in FAILED

    @property
    def queue_seconds(self) -> float | None:
        return None if self.dispatched_at is None else self.dispatched_at - self.enqueued_at

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.enqueued_at

    @property
    def e2e_seconds(self) -> float:
        return self.settled_at - self.enqueued_at
