"""Every rope scaling we serve gives transformers' own frequencies and attention factor, read
from a config.json's dict or a GGUF's keys; the kinds we do not implement are refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from contract.rope import DEFAULT_ROPE, RopeScaling, RopeScalingError, rope_from_gguf, rope_from_hf
from runtime.models.rope import rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES = [
    ("linear", 64, 10000.0, 4096, {"factor": 2.0}),
    ("linear", 128, 500000.0, 8192, {"factor": 8.0}),
    ("llama3", 128, 500000.0, 131072, {"factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    ("llama3", 64, 500000.0, 131072, {"factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    ("yarn", 128, 1000000.0, 131072, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    ("yarn", 64, 10000.0, 16384, {"factor": 4.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    ("yarn", 64, 10000.0, 163840, {"factor": 40.0, "original_max_position_embeddings": 4096,
                                   "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("yarn", 64, 10000.0, 163840, {"factor": 40.0, "original_max_position_embeddings": 4096,
                                   "mscale": 0.707, "mscale_all_dim": 1.0}),
    ("yarn", 64, 10000.0, 16384, {"factor": 4.0, "original_max_position_embeddings": 4096,
                                  "attention_factor": 1.25}),
]


def _reference(kind: str, head_dim: int, theta: float, max_pos: int, params: dict):
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos,
                         rope_parameters={"rope_type": kind, "rope_theta": theta, **params})
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize("kind,head_dim,theta,max_pos,params", CASES)
def test_frequencies_are_transformers(kind, head_dim, theta, max_pos, params):
    want_freq, want_scale = _reference(kind, head_dim, theta, max_pos, params)
    scaling = rope_from_hf({"rope_type": kind, **params}, max_pos)
    freq, scale = rope_frequencies(head_dim, theta, scaling)
    assert freq.dtype == torch.float32
    assert torch.equal(freq, want_freq.float())  # the same float32 operations, in order
    assert scale == pytest.approx(want_scale, rel=1e-12)
    if kind != "linear":  # scaling that changes nothing would pass the equality trivially
        plain, _ = rope_frequencies(head_dim, theta, DEFAULT_ROPE)
        assert not torch.equal(freq, plain)


def test_old_and_new_config_forms_agree():
    old = rope_from_hf({"type": "linear", "factor": 2.0}, 4096)
    new = rope_from_hf({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, 4096)
    assert old == new == RopeScaling("linear", 2.0)
    assert rope_from_hf(None, 4096) is DEFAULT_ROPE
    assert rope_from_hf({"rope_type": "default", "rope_theta": 1e4}, 4096) is DEFAULT_ROPE


def test_yarn_factor_implied_by_the_context_ratio():
    s = rope_from_hf({"rope_type": "yarn", "original_max_position_embeddings": 4096}, 16384)
    assert s.factor == 4.0


@pytest.mark.parametrize("raw", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
    {"type": "su", "factor": 2.0},
])
def test_unimplemented_kinds_are_refused_by_name(raw):
    with pytest.raises(RopeScalingError, match=repr(raw.get("rope_type", raw.get("type")))):
        rope_from_hf(raw, 4096)


@pytest.mark.parametrize("raw", [
    {"rope_type": "llama3", "factor": 8.0},  # no original context
    {"rope_type": "linear"},  # no factor
    {"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 4096},
])
def test_incomplete_parameters_are_refused(raw):
    with pytest.raises(RopeScalingError):
        rope_from_hf(raw, 4096)


def test_gguf_keys():
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert rope_from_gguf(meta, "llama") == RopeScaling("linear", 4.0)
    assert rope_from_gguf({}, "llama") is DEFAULT_ROPE
    assert rope_from_gguf({"qwen2.rope.scaling.type": "none"}, "qwen2") is DEFAULT_ROPE
    yarn = rope_from_gguf({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
                           "qwen3.rope.scaling.original_context_length": 32768,
                           "qwen3.rope.scaling.yarn_beta_fast": 32.0}, "qwen3")
    assert yarn == RopeScaling("yarn", 4.0, 32768)
    # llama.cpp multiplies its own temperature by attn_factor
    tempered = rope_from_gguf({"x.rope.scaling.type": "yarn", "x.rope.scaling.factor": 4.0,
                               "x.rope.scaling.original_context_length": 4096,
                               "x.rope.scaling.attn_factor": 0.5}, "x")
    assert tempered.attention_factor == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1))
    with pytest.raises(RopeScalingError, match="'longrope'"):
        rope_from_gguf({"phi3.rope.scaling.type": "longrope"}, "phi3")


def test_gguf_frequency_factors_are_llama3():
    """Llama 3.1's files carry its scaling as per-dimension factors (llama.cpp's converter's
    formula, testkit/family_gguf.py): dividing plain frequencies by them is transformers'
    llama3 scaling, to float32 rounding (a division where transformers blends)."""
    from testkit.family_gguf import llama3_rope_factors

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params,
                      max_position_embeddings=131072)
    factors = tuple(float(f) for f in llama3_rope_factors(cfg))
    meta = {"llama.rope.freq_base": 500000.0}
    ours, scale = rope_frequencies(128, 500000.0, rope_from_gguf(meta, "llama", factors))
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert scale == 1.0
    torch.testing.assert_close(ours, want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_bad_frequency_factors_are_refused():
    with pytest.raises(RopeScalingError, match="frequency factors with rope scaling yarn"):
        RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256,
                    frequency_factors=(1.0, 2.0))
    with pytest.raises(RopeScalingError, match="positive"):
        RopeScaling(frequency_factors=(1.0, 0.0))
    with pytest.raises(ValueError, match="3 rope frequency factors"):
        rope_frequencies(16, 10000.0, RopeScaling(frequency_factors=(1.0, 2.0, 3.0)))
