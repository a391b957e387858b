"""The 8-bit KV cache's accuracy on the real SmolLM2 model (bench/kv_int8.py's measurement):
five prompts, 64 greedy steps each, with the float32, float16 and int8 caches.

The bound: to first order the logits move in proportion to the perturbation of the K/V
rows, and both narrow caches perturb the same rows by independent rounding, so the int8
cache's logit error against the float32 cache is the float16 cache's times the ratio r of
their RMS K/V errors, measured on the model's own rows (int8: up to absmax / 254 per value;
float16: up to 2^-11 of the value; r is about 50 for this model). A factor 2 over r covers
the softmax's second-order terms. Greedy tokens are reported (printed), not asserted: a
near-tie between two tokens may go either way under any perturbation."""
from __future__ import annotations

from bench.kv_int8 import accuracy


def test_int8_cache_logit_error_is_bounded_by_its_rounding(smollm_checkpoint):
    acc = accuracy(smollm_checkpoint, steps=64)
    r = acc["kv_error_ratio"]
    int8, f16 = acc["int8_vs_float32"], acc["float16_vs_float32"]
    print(f"int8 vs float16 logits: {acc['int8_vs_float16']}; greedy tokens equal: "
          f"{acc['agreeing_tokens']} of {5 * 64}; first divergence per prompt: "
          f"{acc['first_divergence']}; K/V error ratio {r:.1f}")
    assert 8 < r < 200  # int8 is coarser than float16, and not broken
    assert int8["mean"] <= 2 * r * f16["mean"]
    assert int8["max"] <= 2 * r * f16["max"]
    # most steps agree: a broken cache (wrong scales, rows misread) diverges at once
    assert acc["agreeing_tokens"] >= 5 * 64 // 2
    assert all(len(t) == 64 for t in acc["tokens"]["int8"])
