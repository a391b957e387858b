"""What worker handles share with the rest of the gateway: the loss of a worker as an error,
a request's placement on a worker, the events a handle reports, and the final output of a
request that ended with nothing to bill."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.frames import KvEvents, Output, TransferDone
from gateway.workers.output_stream import OutputStream

if TYPE_CHECKING:
    from gateway.workers.handle import WorkerHandle


class WorkerDied(Exception):
    """The worker (its process, or the connection to it) was lost while the request was in
    flight."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class Placement:
    """An engine request this worker has: where its outputs go, and what dispatch weighs."""

    stream: OutputStream
    priority: int
    num_prompt_tokens: int


class WorkerEvents:
    """What a worker handle tells the gateway; the gateway passes its own at construction."""

    def ready(self, worker: WorkerHandle) -> None:
        """A (re)started worker is ready."""

    def output(self, worker: WorkerHandle, out: Output) -> None:
        """Every output, before its request's stream sees it (metering)."""

    def prefilled(self, worker: WorkerHandle, out: Output) -> None:
        """Disaggregation: a request's prompt KV is ready to move."""

    def transferred(self, worker: WorkerHandle, done: TransferDone) -> None:
        """Disaggregation: a KV import finished."""

    def on_kv_events(self, worker: WorkerHandle, frame: KvEvents) -> None:
        """Prefix-cache blocks the worker stored and removed. `cleared`: forget all its
        blocks first; a worker that connects sends one with everything it holds, and a lost
        worker is reported as one cleared frame with nothing stored."""


def ended(request_id: str, reason: str) -> Output:
    """A final output for a request that produced nothing we can bill (refused, or lost)."""
    return {"id": request_id, "tokens": [], "text": "", "finished": True, "reason": reason,
            "stop_reason": None, "usage": None, "logprobs": None, "synthetic": True}
