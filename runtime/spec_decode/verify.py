"""Verification of proposed tokens against the target's distributions, exactly.

Proposals here are deterministic (n-gram lookups and greedy drafts), so the draft distribution
q is one-hot and rejection sampling reduces to: accept draft d with probability p(d); on the
first rejection, sample from p with d removed (renormalised); if every draft is accepted,
sample a bonus token from the next distribution. The output then follows p exactly. Greedy
requests accept the longest run where the draft equals the target's argmax. A structured-output
request's logits arrive masked per position by its grammar (runtime/structured/masks.py): a
draft the grammar refuses has p = 0 there, so it is rejected for sure and the replacement is
drawn from the grammar's tokens.
"""
from __future__ import annotations

import torch

from runtime.execution.sampler import filtered_probs


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits: [k + 1, V] at the positions of the last token and the k drafts."""
    best = logits.argmax(dim=-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if best[i] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def verify_sampled(logits: torch.Tensor, drafts: list[int], params,
                   generator: torch.Generator | None) -> list[int]:
    """Rejection sampling; consumes one uniform per verified draft and one token draw."""
    probs = filtered_probs(logits.float(), [params] * logits.shape[0])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand(1, generator=generator, device=probs.device).item()
        if u < probs[i, d].item():
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        if residual.sum() <= 0:  # p was one-hot on d: cannot reject in exact arithmetic
            out.append(d)
            continue
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=generator).item())


def verify(logits: torch.Tensor, drafts: list[int], params, generator) -> list[int]:
    """Accepted proposals followed by one token from the target (1 to k + 1 tokens)."""
    if params.is_greedy:
        return verify_greedy(logits, drafts)
    return verify_sampled(logits, drafts, params, generator)
