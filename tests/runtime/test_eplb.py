"""The expert-parallel load balancer (runtime/ep/placement.py, packing.py): the placement's
invariants under both policies, what it achieves on a skewed routing trace against the
load-blind placement, determinism and refusals."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.ep.packing import pack, replicate
from runtime.ep.placement import imbalance, rebalance, static_placement
from runtime.ep.trace import counts, hot_ratio, sample_routing, zipf_for_hot_ratio, zipf_popularity

# DeepSeek's own published example of EPLB (two layers of 12 experts, 4 groups)
EXAMPLE = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])


def _skewed_trace(experts=64, k=4, groups=8, kept=4, layers=3, tokens=4096, seed=0):
    """Counts [layers, experts] of two windows of one trace (plan, then apply), hottest
    expert about 8x the mean."""
    s = zipf_for_hot_ratio(8.0, experts, k, groups, kept)
    pop = zipf_popularity(layers, experts, s, seed)
    windows = [np.stack([counts(sample_routing(p, tokens, k, groups, kept, seed=100 * w + i),
                                experts) for i, p in enumerate(pop)]) for w in (1, 2)]
    return windows[0], windows[1]


def _check_invariants(p, loads, workers, redundant):
    layers, experts = loads.shape
    assert p.phys_to_logical.shape == (layers, workers, (experts + redundant) // workers)
    for layer in range(layers):
        flat = p.phys_to_logical[layer].reshape(-1)
        # every logical expert placed, replica counts as declared, sum = slots
        assert np.array_equal(np.bincount(flat, minlength=experts), p.replicas[layer])
        assert p.replicas[layer].min() >= 1 and p.replicas[layer].sum() == experts + redundant
        # the inverse map lists exactly each expert's slots
        for e in range(experts):
            slots = p.logical_to_phys[layer, e]
            slots = slots[slots >= 0]
            assert len(slots) == p.replicas[layer, e]
            assert (flat[slots] == e).all()
    # expected load: every token counted once
    np.testing.assert_allclose(p.expected_load.sum(axis=1), loads.sum(axis=1))


def _only_hot_replicated(loads, replicas):
    """A replicated expert carries at least as many tokens as any unreplicated one."""
    for w, c in zip(loads, replicas):
        if (c > 1).any() and (c == 1).any():
            assert w[c > 1].min() >= w[c == 1].max()


@pytest.mark.parametrize("nodes,groups,policy", [(2, 8, "hierarchical"), (1, 1, "global"),
                                                 (3, 8, "global")])
def test_placement_invariants_and_skewed_trace(nodes, groups, policy):
    workers = 6 if nodes == 3 else 8
    plan, later = _skewed_trace()
    assert 6.5 < hot_ratio(plan) < 9.5  # the stated skew, measured
    redundant = 8  # R = N for 8 workers; 72 slots also split over 6
    p = rebalance(plan, workers, redundant, nodes=nodes, groups=groups)
    assert p.policy == policy
    _check_invariants(p, plan, workers, redundant)
    if policy == "global":
        _only_hot_replicated(plan, p.replicas)
    # before: the identity placement (the load-blind one over the same slots where 64
    # experts do not split over the workers)
    blind = static_placement(plan, workers, 0 if 64 % workers == 0 else redundant)
    before = imbalance(blind.worker_loads(later))
    after = imbalance(p.worker_loads(later))  # planned on one window, measured on the next
    assert before.mean() > 1.5  # the hottest expert's worker carries it whole
    assert after.max() <= 1.3
    assert after.max() < before.min()


def test_hierarchical_keeps_groups_on_nodes_and_replicates_within_them():
    plan, _ = _skewed_trace()
    p = rebalance(plan, 8, 8, nodes=2, groups=8)
    group_of = np.arange(64) // 8
    for layer in range(plan.shape[0]):
        per_node = p.phys_to_logical[layer].reshape(2, -1)
        node_groups = [set(group_of[row].tolist()) for row in per_node]
        assert not node_groups[0] & node_groups[1] and len(node_groups[0]) == 4
        for row in per_node:  # replicas only of the node's hottest experts
            held = np.unique(row)
            _only_hot_replicated(plan[layer:layer + 1, held],
                                 p.replicas[layer:layer + 1, held])


def test_deepseek_example_and_determinism():
    p = rebalance(EXAMPLE, 8, 4, nodes=2, groups=4)
    _check_invariants(p, EXAMPLE.astype(float), 8, 4)
    assert p.policy == "hierarchical"
    # 1.24 is what the groups allow here: each node holds two whole groups
    assert imbalance(p.expected_load).max() < 1.25
    assert imbalance(static_placement(EXAMPLE, 4).expected_load).max() > 1.7
    again = rebalance(EXAMPLE.copy(), 8, 4, nodes=2, groups=4)
    assert np.array_equal(p.phys_to_logical, again.phys_to_logical)


def test_replicas_avoid_one_worker_and_zero_loads_place_everything():
    # one scorching expert: its replicas spread over distinct workers
    loads = np.array([[1000.0] + [1.0] * 15])
    p = rebalance(loads, 4, 4)
    assert p.replicas[0, 0] == 5
    holders = [w for w in range(4) if 0 in p.phys_to_logical[0, w]]
    assert len(holders) == 4
    quiet = rebalance(np.zeros((2, 16)), 4, 4, nodes=2, groups=4)
    _check_invariants(quiet, np.zeros((2, 16)), 4, 4)
    assert (imbalance(quiet.expected_load) == 1.0).all()


def test_pack_and_replicate_directly():
    w = np.array([7.0, 5, 4, 4, 3, 3, 2, 2])
    where = pack(w, 2)
    assert np.bincount(where).tolist() == [4, 4]
    assert sorted(np.bincount(where, weights=w).tolist()) == [15.0, 15.0]  # the optimum
    assert replicate(np.array([9.0, 3, 1]), 5).tolist() == [3, 1, 1]


@pytest.mark.parametrize("args,match", [
    ((np.ones((1, 10)), 4, 0), "split evenly over 4 workers"),
    ((np.ones((1, 16)), 6, 2, 4), "do not split evenly over 4 nodes"),
    ((np.ones((1, 16)), 4, 0, 1, 3), "3 equal groups"),
    ((-np.ones((1, 16)), 4, 0), "non-negative"),
    ((np.ones(16), 4, 0), r"\[layers, experts\]"),
])
def test_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance(*args)
    with pytest.raises(ValueError, match="cannot hold"):
        replicate(np.ones(4), 3)
    with pytest.raises(ValueError, match="hierarchical policy"):
        rebalance(np.ones((1, 16)), 6, 2, nodes=3, groups=4, policy="hierarchical")
