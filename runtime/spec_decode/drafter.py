"""Model drafters: a small model proposes tokens greedily, one batched forward per token.

Self-draft uses the target's own first L layers, final norm and LM head, and the target's KV
cache for those layers (the target's forward keeps it filled). A draft model has its own
weights and its own KV cache laid out on the same block tables; before drafting it runs over
the step's regular tokens too, so its cache keeps pace with the target's.
Greedy drafts make the draft distribution one-hot, which keeps verification exact.
"""
from __future__ import annotations

import copy

import torch

from runtime.scheduler import ScheduledRequest, SchedulerOutput


class ModelDrafter:
    def __init__(self, runner, model, kv_caches, catch_up: bool):
        self.runner = runner
        self.model = model
        self.kv_caches = kv_caches
        self.catch_up = catch_up

    @classmethod
    def self_draft(cls, runner, num_layers: int) -> "ModelDrafter":
        target = runner.model
        if not 0 < num_layers < len(target.layers):
            raise ValueError(f"self:{num_layers} needs 0 < L < {len(target.layers)} layers")
        model = copy.copy(target)  # shares every tensor; only the layer list is shorter
        model.layers = target.layers[:num_layers]
        return cls(runner, model, runner.kv_caches[:num_layers], catch_up=False)

    @classmethod
    def draft_model(cls, runner, checkpoint) -> "ModelDrafter":
        from runtime.model import LlamaModel
        cfg = checkpoint.config
        if cfg.vocab_size != runner.model_cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size}) differs from "
                             f"the target's ({runner.model_cfg.vocab_size})")
        model = LlamaModel(cfg, checkpoint.weights, str(runner.device), runner.dtype)
        shape = (runner.num_blocks * runner.block_size, cfg.num_key_value_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                   torch.zeros(shape, dtype=runner.dtype, device=runner.device))
                  for _ in range(cfg.num_hidden_layers)]
        return cls(runner, model, caches, catch_up=True)

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> None:
        """Fill `spec_token_ids` of every speculating request with `num_spec` greedy drafts.
        Called only in steps that speculate: a draft model first catches up on every position
        its cache lacks (since its last use), so steps without speculation cost it nothing."""
        spec = [s for s in out.scheduled if s.num_spec]
        for s in spec:
            s.request.spec_token_ids = []
        if self.catch_up:
            first = self._catch_up_batch(out)
        elif spec:  # the target's cache already holds every earlier position for these layers
            first = SchedulerOutput([ScheduledRequest(s.request, 1, s.start_position)
                                     for s in spec])
        else:
            return
        self._draft_one(first, spec)
        if not spec:
            return
        for j in range(1, max(s.num_spec for s in spec)):
            active = [s for s in spec if s.num_spec > j]
            step = SchedulerOutput([ScheduledRequest(s.request, 1, s.start_position + j)
                                    for s in active])
            self._draft_one(step, active)

    def _catch_up_batch(self, out: SchedulerOutput) -> SchedulerOutput:
        """Every scheduled request's regular tokens, from the first position the draft cache
        lacks: positions it wrote that are no longer computed (rejected drafts, preemption) and
        prefix-cache hits are (re)written. Proposals written earlier and accepted stay."""
        batch = []
        for s in out.scheduled:
            r = s.request
            end = s.start_position + s.num_new_tokens - s.num_spec
            begin = min(r.draft_written, r.num_computed_tokens, s.start_position)
            batch.append(ScheduledRequest(r, end - begin, begin))
            r.draft_written = end + max(0, s.num_spec - 1)  # drafts 1..k-1 are written too
        return SchedulerOutput(batch)

    def _draft_one(self, batch: SchedulerOutput, spec: list) -> None:
        input_ids, meta, last_index = self.runner.prepare(batch, self.model.cfg)
        hidden = self.model.forward(input_ids, meta, self.kv_caches)
        if not spec:
            return
        idx = torch.tensor([last_index[s.request.request_id] for s in spec],
                           device=hidden.device)
        drafts = self.model.compute_logits(hidden.index_select(0, idx)).argmax(dim=-1).tolist()
        for s, token in zip(spec, drafts):
            s.request.spec_token_ids.append(token)
