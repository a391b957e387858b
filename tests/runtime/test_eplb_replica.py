"""Which replica computes each token (runtime/ep/replica.py) and the load window the balancer
plans from (runtime/ep/load_window.py): an even split, a real MoE block's output unchanged
when its tokens are computed by the placement's replicas, and the window fed by ExpertLoad."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.ep.load_window import ExpertLoadWindow
from runtime.ep.moe_layer import random_moe
from runtime.ep.placement import rebalance
from runtime.ep.replica import choose_replicas
from runtime.models.moe import ExpertLoad, SparseMoE
from testkit.tolerances import relative_error


def _layer(p, layer=0):
    return torch.from_numpy(p.logical_to_phys[layer]), torch.from_numpy(p.replicas[layer])


def test_hot_expert_tokens_split_evenly_and_deterministically():
    loads = np.array([[800.0] + [100.0] * 15])
    p = rebalance(loads, 4, 4)
    l2p, reps = _layer(p)
    assert int(reps[0]) == 5
    ids = torch.zeros(23, 1, dtype=torch.long)  # 23 tokens, all to expert 0
    for offset in (0, 3):
        chosen = choose_replicas(ids, l2p, reps, offset)
        per_slot = torch.bincount(chosen.reshape(-1), minlength=20)[l2p[0]]
        assert per_slot.sum() == 23 and per_slot.max() - per_slot.min() <= 1
        assert torch.equal(chosen, choose_replicas(ids, l2p, reps, offset))
    # the extra tokens move with the offset: over 5 one-token calls every replica gets one
    singles = [int(choose_replicas(ids[:1], l2p, reps, step)) for step in range(5)]
    assert sorted(singles) == sorted(l2p[0].tolist())
    # each slot chosen holds the expert asked for
    mixed = torch.randint(0, 16, (50, 4), generator=torch.Generator().manual_seed(1))
    chosen = choose_replicas(mixed, l2p, reps)
    assert torch.equal(torch.from_numpy(p.phys_to_logical[0].reshape(-1))[chosen], mixed)
    with pytest.raises(ValueError, match="expert ids outside"):
        choose_replicas(mixed + 16, l2p, reps)


def _placed_forward(moe: SparseMoE, x: torch.Tensor, phys_to_logical: torch.Tensor,
                    l2p: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """The routed sum computed as expert parallelism would: each assignment sent to its
    chosen slot, each slot running its logical expert's weights on the rows it received."""
    weights, ids = moe.router(x)
    slot = choose_replicas(ids, l2p, reps, offset=7).reshape(-1)
    k = ids.shape[1]
    out = torch.zeros_like(x)
    for s in torch.unique(slot).tolist():
        picked = torch.nonzero(slot == s).reshape(-1)
        tokens = picked // k
        e = int(phys_to_logical[s])
        y = moe.down[e](torch.nn.functional.silu(moe.gate_up[e](x[tokens])[:, :32])
                        * moe.gate_up[e](x[tokens])[:, 32:])
        out.index_add_(0, tokens, y * weights.reshape(-1)[picked][:, None])
    return out


def test_outputs_do_not_depend_on_the_replica_or_the_placement():
    load = ExpertLoad(1, 16, torch.device("cpu"))
    moe = random_moe(64, 32, 16, 4, groups=4, groups_kept=2, seed=3, load=load)
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = moe.router(x)
    reference = moe.routed(x, weights, ids)
    # a placement planned from this very batch's counts (hot experts get replicas) and one
    # from made-up loads: both compute the same sum
    skewed = np.arange(16, dtype=float)[None, :] ** 3
    for loads in (load.total().numpy(), skewed):
        p = rebalance(loads, 4, 8, nodes=2, groups=4)
        assert p.replicas[0].max() > 1
        got = _placed_forward(moe, x, torch.from_numpy(p.phys_to_logical[0].reshape(-1)),
                              *_layer(p))
        # float32 both ways; only the rows' grouping into GEMMs and the order of the k-term
        # sums differ: a few float32 ulps of the largest value
        assert relative_error(got, reference) < 1e-5


def test_window_keeps_the_last_k_steps_from_expert_load():
    load = ExpertLoad(2, 4, torch.device("cpu"))
    window = ExpertLoadWindow(2, 4, steps=3)
    window.observe(load)  # the starting point
    assert window.steps == 0 and window.totals().sum() == 0
    steps = [torch.tensor([[0, 0, 0, 0], [s, 1, 0, 2 * s]]) for s in range(1, 6)]
    for s in steps:
        load.add(1, s[1])
        window.observe(load)
    assert window.steps == 3
    assert window.totals().tolist() == sum(steps[2:]).tolist()  # the last three only
    assert load.total()[1].tolist() == sum(steps)[1].tolist()  # the counter is not reset
    # a snapshot's cumulative lists work the same; a total that went down restarts
    window.push_total(load.total().tolist())
    assert window.totals()[1].tolist() == (steps[3] + steps[4])[1].tolist()
    window.push_total([[0] * 4, [1, 1, 1, 1]])
    window.push_total([[0] * 4, [2, 1, 1, 1]])
    assert window.totals()[1].tolist() == (steps[4][1] + torch.tensor([1, 0, 0, 0])).tolist()
    with pytest.raises(ValueError, match="shape"):
        window.push(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="negative"):
        window.push(-np.ones((2, 4)))
