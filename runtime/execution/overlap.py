"""Overlapped steps: the host plans and launches step N+1 while the device still runs step N.

The way SGLang's overlap scheduler and vLLM's async scheduling do it. A step is launched
without reading back what it samples: each request that sampled gets a placeholder token
(`Request.num_placeholders`), the scheduler plans the next step over it, and the runner fills
that step's placeholder rows from the previous step's sampled tokens on the device
(`placeholder_fill`). The previous step's results are read back (one copy, already under way)
and processed (detokenized, checked for stops, streamed) while the new step runs, so its
outputs leave one step later and nothing the host does stands between two launches.

Outputs are unchanged. A request that finished in step N (a stop token, a stop string) was
already planned into step N+1: that row's work is thrown away, and its blocks, freed when
step N is processed, are reused only by steps launched after N+1 on the same stream. A
request that certainly ends (its last allowed token is in flight) is not planned again.

Steps that need the previous step's tokens on the host run in order instead: a grammar's
mask, penalties over the output so far, and speculation (n-gram lookups and drafts read the
last token). The engine overlaps only while no request in it needs one of those.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from contract.config import OVERLAP_MODES
from contract.outputs import StepSample, TokenLogprob
from runtime.execution.sampler import DeviceSample
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.scheduling.request import PLACEHOLDER, Request


def overlap_enabled(mode: str, device: torch.device) -> bool:
    """`auto` overlaps on CUDA, where launches are asynchronous. On the CPU every op runs
    as it is called, so there is nothing to overlap and `auto` keeps steps in order; `on`
    still works there (the tests run it) but buys nothing."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, not {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def needs_ordered_steps(request: Request, speculating: bool) -> bool:
    """True when the request's next step needs its last sampled token on the host."""
    return speculating or request.grammar is not None or request.params.needs_penalties \
        or (request.think is not None and request.think.active)  # it may force its end marker


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on the device: `sample` holds one row
    per plain sampling request (`rows` maps its id to the row); prompt logprobs, computed at
    launch, are in `partial`."""

    sample: DeviceSample | None = None
    rows: dict[str, int] = field(default_factory=dict)
    partial: StepSample = field(default_factory=StepSample)

    def result(self) -> StepSample:
        """Wait for the step's tokens and return them as the runner's `run` would."""
        result = self.partial
        if self.sample is None:
            return result
        sampled = self.sample.result()
        for rid, i in self.rows.items():
            result.tokens[rid] = [sampled.token_ids[i]]
            if sampled.logprobs[i] is not None:
                result.logprobs[rid] = [TokenLogprob(sampled.token_ids[i], sampled.logprobs[i],
                                                     tuple(sampled.top_logprobs[i] or ()))]
        return result


@dataclass
class InFlight:
    """The step launched last and not processed yet: its plan and its pending results."""

    sched: SchedulerOutput
    pending: PendingStep


def placeholder_fill(batch: Sequence[ScheduledRequest], last_index: Mapping[str, int],
                     previous: PendingStep | None, device: torch.device
                     ) -> Callable[[torch.Tensor], None] | None:
    """What writes the step's placeholder tokens into its packed `input_ids` on the device,
    from the previous step's sampled tokens; None when the step has no placeholder. A
    placeholder is only ever a request's last token, and only after a step that sampled it."""
    dst, src = [], []
    for s in batch:
        if PLACEHOLDER not in s.token_ids:
            continue
        if s.token_ids.index(PLACEHOLDER) != len(s.token_ids) - 1 or previous is None \
                or s.request_id not in previous.rows:
            raise RuntimeError(f"request {s.request_id!r}: a placeholder token the previous "
                               f"step did not sample")
        dst.append(last_index[s.request_id])
        src.append(previous.rows[s.request_id])
    if not dst:
        return None
    assert previous is not None and previous.sample is not None
    tokens = previous.sample.tokens
    dst_rows = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
    src_rows = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)

    def fill(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, dst_rows, tokens.index_select(0, src_rows))
    return fill
