"""The expert-parallel simulator (runtime/ep/sim.py, `python -m runtime.ep_sim`): a small
configuration runs fast, the balancer lowers its imbalance and step time, its throughput moves
as the costs say, and the command prints the table beside the published figures."""
from __future__ import annotations

import dataclasses

import pytest

from runtime import ep_sim
from runtime.ep import costs
from runtime.ep.sim import Deployment, simulate

SMALL = costs.ModelShape(layers=5, moe_layers=4, experts=64, k=4, hidden=256,
                         moe_intermediate=64, dense_intermediate=512, groups=8, groups_kept=4,
                         heads=4, q_lora=64, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
                         vocab=1000)
HW = costs.Hardware()


def _prefill(**kw) -> Deployment:
    base = dict(phase="prefill", gpus=16, redundant=16, tokens_per_gpu=4096, context=512.0,
                sample_per_gpu=128, history_per_gpu=256)
    return Deployment(**{**base, **kw})


def test_small_config_balancer_lowers_imbalance_and_step_time():
    # prefill on 2 nodes (hierarchical), decode on 3 (8 groups: global)
    for dep, policy in ((_prefill(), "hierarchical"),
                        (_prefill(phase="decode", gpus=24, redundant=8, tokens_per_gpu=64,
                                  mtp_accept=0.8), "global")):
        r = simulate(dep, SMALL, HW, zipf_s=0.8)
        assert r.policy == policy
        assert r.hot_ratio > 4  # a skewed trace, measured
        assert r.eplb.imbalance < r.static.imbalance
        assert r.eplb.imbalance < 1.5
        assert r.eplb.step_s <= r.static.step_s
        assert r.eplb.per_gpu.shape == (dep.gpus,)


def test_throughput_follows_the_costs():
    # only the routed experts cost time (a fixed per-token cost, free attention and links):
    # doubling the expert cost halves the throughput exactly
    free = costs.Hardware(nvlink_gbs=1e12, ib_gbs=1e12, fp8_tflops=1e12, bf16_tflops=1e12,
                          hbm_gbs=1e12)
    dep = _prefill(expert_s_per_token=1e-6, attn_s_per_token=0.0)
    one = simulate(dep, SMALL, free, zipf_s=0.8)
    two = simulate(dataclasses.replace(dep, expert_s_per_token=2e-6), SMALL, free, zipf_s=0.8)
    assert two.eplb.tokens_per_s_gpu(dep) == pytest.approx(one.eplb.tokens_per_s_gpu(dep) / 2,
                                                          rel=1e-6)
    # and with the roofline: halving the InfiniBand bandwidth slows a link-bound step, and
    # without overlap the all-to-all adds to the compute
    slow = costs.Hardware(ib_gbs=HW.ib_gbs / 2)
    base = simulate(_prefill(), SMALL, HW, zipf_s=0.8)
    assert simulate(_prefill(), SMALL, slow, zipf_s=0.8).eplb.step_s > base.eplb.step_s
    assert simulate(_prefill(overlap=False), SMALL, HW, zipf_s=0.8).eplb.step_s \
        > base.eplb.step_s


def test_refusals():
    with pytest.raises(ValueError, match="phase"):
        _prefill(phase="train")
    with pytest.raises(ValueError, match="fill nodes"):
        simulate(_prefill(gpus=12, redundant=20), SMALL, HW, zipf_s=0.8)


def test_command_prints_the_table(capsys):
    assert ep_sim.main(["--layers-simulated", "1", "--sample-per-gpu", "16",
                        "--history-per-gpu", "32", "--zipf-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "| prefill | 32 | 32 |" in out and "| decode | 144 | 32 |" in out
    assert "73,700" in out and "14,800" in out and "notes:" in out
    assert out.count("per-GPU received tokens") == 4
