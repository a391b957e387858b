"""Which replica computes each (token, expert) assignment of a step, given a placement.

Replicas of an expert hold the same weights, so the choice changes who computes, never what
is computed: a token's output is the same whichever replica runs it (up to the GEMM's row
grouping). The choice only has to spread an expert's tokens evenly, deterministically:
the expert's assignments in token order (token index, then k) go round-robin over its
replicas, starting at `offset`: the j-th goes to replica (j + offset) mod count. Within one
call every replica of an expert gets the same number of its tokens, give or take one; a caller
issuing many small batches (decode, or each worker routing its own tokens) passes a different
offset each time (its step number, its rank) so that the extra ones do not all land on
replica 0.
"""
from __future__ import annotations

import torch


def choose_replicas(ids: torch.Tensor, logical_to_phys: torch.Tensor, replicas: torch.Tensor,
                    offset: int = 0) -> torch.Tensor:
    """Physical slot (flat id) for each assignment: ids int64 [T, k] logical experts of one
    layer; logical_to_phys int64 [experts, max replicas] and replicas int64 [experts] that
    layer's rows of a `Placement` (as tensors). Returns int64 [T, k]."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= replicas.shape[0]):
        raise ValueError(f"expert ids outside 0..{replicas.shape[0] - 1}")
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in token order
    sorted_ids = flat[order]
    run_start = torch.searchsorted(sorted_ids, sorted_ids)  # first index of each one's run
    within = torch.arange(flat.numel(), device=flat.device) - run_start
    rank = (within + offset) % replicas[sorted_ids]
    chosen = torch.empty_like(flat)
    chosen[order] = logical_to_phys[sorted_ids, rank]
    return chosen.view_as(ids)
