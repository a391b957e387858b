"""The surface a worker drives, whatever engine is behind it.

`LLMEngine` (the model) and `FakeEngine` (no model, for gateway tests and benchmarks) both
implement it; `runtime/transport/worker.py` drives one over frames, and
`tests/runtime/test_engine_contract.py` holds all of them, the worker process included, to the
same behaviour.

Invariants every implementation keeps:
- `add_request` validates first and changes nothing when it raises (a `RuntimeErrorBase`).
- each request yields exactly one finished output, whatever ends it (stop, length, abort);
  `abort_request` returns that final output at once, or None for an unknown id.
- a finished output's usage counts every output token the request produced.
- `step` is only called while `has_unfinished_requests()`.
- `drain_kv_events` reports each cached block hash whose state changed since the last drain,
  once, with its latest state; applied to the last `kv_snapshot` (or to an empty view), the
  batches give exactly the blocks `kv_snapshot` would list now (runtime/kv/events.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from contract.outputs import RequestOutput, StepStats
from contract.sampling_params import SamplingParams

if TYPE_CHECKING:
    from contract.frames import KvEvents
    from contract.tokenizer import Tokenizer


@runtime_checkable
class EngineCore(Protocol):
    tokenizer: Tokenizer  # what the gateway detokenizes with

    def info(self) -> dict:
        """Plain facts for the worker's Ready frame (model, limits, block size, device)."""

    def snapshot(self) -> dict:
        """Gauges and counters now, for the worker's stats."""

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams = ..., priority: int = 0,
                    cache_salt: str | None = None) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> tuple[list[RequestOutput], StepStats]: ...

    def drain_kv_events(self) -> KvEvents | None:
        """Cached blocks stored and removed since the last drain; None when none changed."""

    def kv_snapshot(self) -> KvEvents:
        """Every cached block held now, `cleared` set: replaces a gateway's view."""

    def close(self) -> None: ...
