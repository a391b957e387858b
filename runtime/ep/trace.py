"""Synthetic routing traces with a stated skew, for the balancer's tests and the simulator.

Each layer gets a Zipf-like popularity over its experts (the expert of rank r weighs
1 / (r + 1)^s, ranks shuffled per layer by the seed), and each token picks its k experts
as a router would: distinct experts drawn in proportion to popularity (Gumbel top-k over the
log-popularity, i.e. sampling without replacement), limited to the `groups_kept` best of
`groups` expert groups as DeepSeek-V3's router is (groups ranked by their two best perturbed
scores). The skew that matters is measured, not assumed: `hot_ratio` is the hottest expert's
tokens over the mean, and `zipf_for_hot_ratio` finds the exponent that gives a target ratio.
"""
from __future__ import annotations

import numpy as np
import torch


def zipf_popularity(layers: int, experts: int, s: float, seed: int) -> torch.Tensor:
    """float64 [layers, experts], each row summing to 1."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    rows = [base[torch.randperm(experts, generator=g)] for _ in range(layers)]
    pop = torch.stack(rows)
    return pop / pop.sum(dim=1, keepdim=True)


def sample_routing(popularity: torch.Tensor, tokens: int, k: int, groups: int = 1,
                   groups_kept: int = 1, seed: int = 0) -> torch.Tensor:
    """int64 [tokens, k]: each token's k distinct experts for one layer's popularity [E]."""
    experts = popularity.shape[0]
    if experts % groups or groups_kept > groups or k > (experts // groups) * groups_kept:
        raise ValueError("the groups cannot hold k experts per token")
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(tokens, experts, generator=g).clamp_min(1e-30)
    scores = popularity.float().log()[None, :] - torch.log(-torch.log(u))  # Gumbel-perturbed
    if groups > 1:
        per = experts // groups
        top2 = scores.view(tokens, groups, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)
        best = top2.topk(groups_kept, dim=-1)[1]
        kept = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, best, True)
        scores = scores.masked_fill(~kept.repeat_interleave(per, dim=1), float("-inf"))
    return scores.topk(k, dim=-1)[1]


def counts(ids: torch.Tensor, experts: int) -> np.ndarray:
    """int64 [experts]: tokens routed to each expert."""
    return torch.bincount(ids.reshape(-1), minlength=experts).numpy()


def hot_ratio(loads: np.ndarray) -> float:
    """The hottest expert's tokens over the mean, averaged over layers ([layers, experts])."""
    w = np.asarray(loads, dtype=np.float64).reshape(-1, np.shape(loads)[-1])
    return float((w.max(axis=1) / w.mean(axis=1)).mean())


def zipf_for_hot_ratio(target: float, experts: int, k: int, groups: int = 1,
                       groups_kept: int = 1, tokens: int = 2048, seed: int = 0) -> float:
    """The exponent s whose sampled trace has the hottest expert `target` times the mean
    (bisection to 0.01 on four sampled layers, whose shuffles differ; the ratio grows
    with s)."""
    ceiling = experts / k  # an expert in every token's choice
    if not 1.0 <= target < ceiling:
        raise ValueError(f"a hot ratio must be in [1, {ceiling:g}) for {experts} experts, k={k}")
    lo, hi = 0.0, 4.0
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        pop = zipf_popularity(4, experts, mid, seed)
        got = hot_ratio(np.stack([counts(sample_routing(p, tokens, k, groups, groups_kept,
                                                        seed + i), experts)
                                  for i, p in enumerate(pop)]))
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2
