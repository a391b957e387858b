"""Model drafters: a small model proposes tokens greedily, one batched forward per token.

Self-draft uses the target's own first L layers, final norm and LM head, and the target's KV
cache for those layers (the target's forward keeps it filled). A draft model has its own
weights and its own KV cache laid out on the same block tables; before drafting it runs over
the step's regular tokens too, so its cache keeps pace with the target's; how far it got
for each request is the drafter's own state, dropped when the request finishes.
Greedy drafts make the draft distribution one-hot, which keeps verification exact.
Drafters return their proposals; they change no request.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from runtime.kv.cache_format import cache_shape
from runtime.loading.loader import load_checkpoint
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.mtp_drafter import MTPDrafter

if TYPE_CHECKING:
    from runtime.scheduling.request import Request


class ModelDrafter:
    follows_target = False  # nothing to do after the target's step (an MTP drafter has)

    def __init__(self, runner, model, kv_caches, catch_up: bool):
        self.runner = runner
        self.model = model
        self.kv_caches = kv_caches
        self.catch_up = catch_up
        self._written: dict[str, int] = {}  # request id -> positions [0, n) in the draft cache

    @classmethod
    def self_draft(cls, runner, num_layers: int) -> ModelDrafter:
        target = runner.model
        if not 0 < num_layers < len(target.layers):
            raise ValueError(f"self:{num_layers} needs 0 < L < {len(target.layers)} layers")
        model = copy.copy(target)  # shares every tensor; only the layer list is shorter
        model.layers = target.layers[:num_layers]
        return cls(runner, model, runner.kv_caches[:num_layers], catch_up=False)

    @classmethod
    def draft_model(cls, runner, checkpoint) -> ModelDrafter:
        cfg = checkpoint.config
        if cfg.vocab_size != runner.model_cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size}) differs from "
                             f"the target's ({runner.model_cfg.vocab_size})")
        model = runner.build_model(cfg, checkpoint.weights)
        shape = cache_shape(cfg, runner.num_blocks * runner.block_size, runner.kv_dtype)
        caches = [(torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device),
                   torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device))
                  for _ in range(cfg.num_hidden_layers)]
        return cls(runner, model, caches, catch_up=True)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._written.pop(rid, None)

    def observe(self, batch, requests, hidden, last_index, result) -> None:
        """Nothing: a draft model catches up in `propose` (only an MTP drafter follows)."""

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, requests: Mapping[str, Request]
                ) -> dict[str, tuple[int, ...]]:
        """`num_spec` greedy drafts for every speculating request, by request id. Called only
        in steps that speculate: a draft model first catches up on every position its cache
        lacks (since its last use), so steps without speculation cost it nothing."""
        spec = [s for s in out.scheduled if s.num_spec]
        if not spec:
            return {}
        drafts: dict[str, list[int]] = {s.request_id: [] for s in spec}
        if self.catch_up:
            first = self._catch_up_batch(out, requests)
        else:  # the target's cache already holds every earlier position for these layers
            first = [_decode(s, 0, s.token_ids[-1]) for s in spec]
        self._draft_one(first, spec, drafts)
        for j in range(1, max(s.num_spec for s in spec)):
            active = [s for s in spec if s.num_spec > j]
            self._draft_one([_decode(s, j, drafts[s.request_id][j - 1]) for s in active],
                            active, drafts)
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    def _catch_up_batch(self, out: SchedulerOutput,
                        requests: Mapping[str, Request]) -> list[ScheduledRequest]:
        """Every scheduled request's regular tokens, from the first position the draft cache
        lacks: positions it wrote that are no longer computed (rejected drafts, preemption) and
        prefix-cache hits are (re)written. Proposals written earlier and accepted stay."""
        batch = []
        for s in out.scheduled:
            end = s.start_position + len(s.token_ids)
            begin = min(self._written.get(s.request_id, 0), s.start_position)
            tokens = s.token_ids if begin == s.start_position else \
                tuple(requests[s.request_id].token_slice(begin, end))
            batch.append(ScheduledRequest(s.request_id, begin, tokens, s.block_ids))
            self._written[s.request_id] = end + max(0, s.num_spec - 1)  # drafts 1..k-1 too
        return batch

    def _draft_one(self, batch: list[ScheduledRequest], spec: list[ScheduledRequest],
                   drafts: dict[str, list[int]]) -> None:
        input_ids, meta, last_index = self.runner.prepare(batch, self.model.cfg)
        hidden = self.model.forward(input_ids, meta, self.kv_caches)
        idx = torch.tensor([last_index[s.request_id] for s in spec], device=hidden.device)
        tokens = self.model.compute_logits(hidden.index_select(0, idx)).argmax(dim=-1).tolist()
        for s, token in zip(spec, tokens):
            drafts[s.request_id].append(token)


Drafter = ModelDrafter | MTPDrafter  # what the runner calls: propose, forget (and observe)


def _decode(s: ScheduledRequest, offset: int, token: int) -> ScheduledRequest:
    """One token of a speculating request at `offset` past its start: the draft model's
    input for its next draft."""
    return ScheduledRequest(s.request_id, s.start_position + offset, (token,), s.block_ids)


def make_drafter(spec: SpecConfig, runner, weights: Mapping[str, torch.Tensor] | None = None
                 ) -> Drafter | None:
    """The drafter `--spec` asks for: the target's first layers, a draft model, the
    checkpoint's multi-token-prediction layer (from `weights`, the target's checkpoint), or
    none (n-gram proposals and no speculation need no model)."""
    if spec.method == "mtp":
        return MTPDrafter(runner, weights)
    if spec.method == "self":
        return ModelDrafter.self_draft(runner, spec.num_layers)
    if spec.method == "draft":
        return ModelDrafter.draft_model(runner, load_checkpoint(spec.draft_path))
    return None


def draft_cost(runner) -> float:
    """One draft token's work relative to a target step: the weights it reads."""
    if runner.drafter is None:
        return 0.0
    size = lambda m: sum(lin.weight.numel() for lin in m.linears())  # noqa: E731
    return size(runner.drafter.model) / size(runner.model)
