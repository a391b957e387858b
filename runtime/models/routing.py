"""The routers of mixture-of-experts layers: which k experts each token runs, and with what weight.

Each router takes the router's logits (float32 [T, E], `x @ gate.T` computed in float32 whatever
the model's dtype, as DeepSeek's and Mixtral's reference code does: a rounded logit can change
which expert is chosen) and returns (weights float32 [T, k], expert ids int64 [T, k]), in no
particular order along k (the experts' outputs are summed).

- `softmax_topk`: softmax over every expert, the k most probable (Mixtral, Qwen2/3-MoE,
  DeepSeek-V2's `greedy`). Mixtral's "softmax over the top-k logits" is the same thing with
  `normalize` (the k probabilities divided by their sum).
- `softmax_group_topk`: DeepSeek-V2's `group_limited_greedy`: the experts split into groups,
  each group ranked by its most probable expert, the k chosen from the best `groups_kept`.
- `sigmoid_group_topk`: DeepSeek-V3's `noaux_tc`: sigmoid scores; the load-balancing
  correction bias is added for choosing only; groups ranked by the sum of their two best
  biased scores; the weights are the unbiased scores of the chosen experts.

`normalize` divides the k weights by their sum (`norm_topk_prob`), and every router then
multiplies them by `scale` (`routed_scaling_factor`), as transformers' modules do.
"""
from __future__ import annotations

import torch

from contract.config import ModelConfig


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return _finish(weights, ids, normalize, scale)


def softmax_group_topk(logits: torch.Tensor, k: int, groups: int, groups_kept: int,
                       normalize: bool, scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    t, e = probs.shape
    group_scores = probs.view(t, groups, e // groups).amax(dim=-1)
    kept = _group_mask(group_scores, groups_kept, e // groups)
    weights, ids = torch.topk(probs.masked_fill(~kept, 0.0), k, dim=-1)
    return _finish(weights, ids, normalize, scale)


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, groups: int,
                       groups_kept: int, normalize: bool, scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    t, e = choice.shape
    if groups > 1:
        group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
        kept = _group_mask(group_scores, groups_kept, e // groups)
        choice = choice.masked_fill(~kept, float("-inf"))
    ids = torch.topk(choice, k, dim=-1)[1]
    return _finish(scores.gather(1, ids), ids, normalize, scale)


def _group_mask(group_scores: torch.Tensor, groups_kept: int, per_group: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `groups_kept` best groups."""
    best = torch.topk(group_scores, groups_kept, dim=-1)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.repeat_interleave(per_group, dim=1)


def _finish(weights: torch.Tensor, ids: torch.Tensor, normalize: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


class Router:
    """One layer's router: its float32 gate [E, H] (and DeepSeek-V3's correction bias [E]),
    kept out of the quantized Linears: a rounded gate changes which experts run."""

    def __init__(self, cfg: ModelConfig, gate: torch.Tensor, bias: torch.Tensor | None = None):
        self.gate = gate.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.kind = cfg.router
        self.k = cfg.experts_per_token
        self.normalize = cfg.router_normalizes
        self.scale = cfg.routed_scaling_factor
        self.groups, self.groups_kept = cfg.router_groups, cfg.router_groups_kept
        if self.kind == "sigmoid_group_topk" and self.groups > 1 \
                and cfg.num_experts // self.groups < 2:
            raise ValueError("sigmoid group routing ranks groups by their two best experts: "
                             "groups of one expert are not served")
        if self.kind != "sigmoid_group_topk" and self.bias is not None:
            raise ValueError(f"a score correction bias with router {self.kind!r}")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.gate)
        if self.kind == "softmax_topk":
            return softmax_topk(logits, self.k, self.normalize, self.scale)
        if self.kind == "softmax_group_topk":
            return softmax_group_topk(logits, self.k, self.groups, self.groups_kept,
                                      self.normalize, self.scale)
        return sigmoid_group_topk(logits, self.bias, self.k, self.groups, self.groups_kept,
                                  self.normalize, self.scale)
