"""A model's rotary position settings, read from either kind of checkpoint, torch-free.

Hugging Face's `config.json` nests them in `rope_scaling` (transformers < 5) or
`rope_parameters` (>= 5); a GGUF file keeps them as `{arch}.rope.*` keys. Both come here to
one frozen `RopeScaling`, part of the hashable `ModelConfig`; runtime/models/rope.py turns it
into frequencies. A kind we do not implement is refused by name at load, never served with
plain frequencies (the model would answer, wrongly, past its original context and near it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# what runtime/models/rope.py computes; "default" is plain RoPE
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeScalingError(ValueError):
    """A rope scaling the runtime does not implement (named), or one missing a parameter."""


@dataclass(frozen=True)
class RopeScaling:
    """`type` and the parameters its formula reads; 0 or None where the type reads none."""

    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None derives it from the factor
    mscale: float = 0.0  # yarn (DeepSeek's): with mscale_all_dim, the attention factor's ratio
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the correction range outward
    # a GGUF's `rope_freqs` tensor (llama.cpp's converter writes Llama 3.1's llama3 scaling
    # so): each rotated half-dimension's frequency divided by its factor, after the type's
    frequency_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise RopeScalingError(f"unsupported rope scaling {self.type!r} (this runtime "
                                   f"implements {', '.join(ROPE_TYPES)})")
        if self.type != "default" and not self.factor > 0:
            raise RopeScalingError(f"rope scaling {self.type} needs a positive factor, "
                                   f"not {self.factor!r}")
        if self.frequency_factors and self.type not in ("default", "linear"):
            raise RopeScalingError(f"rope frequency factors with rope scaling {self.type} "
                                   "(this runtime applies them to plain or linear RoPE)")
        if any(not f > 0 for f in self.frequency_factors):
            raise RopeScalingError("rope frequency factors must be positive")
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise RopeScalingError(f"rope scaling {self.type} needs "
                                   "original_max_position_embeddings")


DEFAULT_ROPE = RopeScaling()


def rope_from_hf(raw: dict | None, max_position_embeddings: int) -> RopeScaling:
    """From a config.json's `rope_scaling` / `rope_parameters` dict (None: plain RoPE)."""
    if not raw:
        return DEFAULT_ROPE
    kind = raw.get("rope_type", raw.get("type")) or "default"
    if kind == "default":
        return DEFAULT_ROPE
    original = raw.get("original_max_position_embeddings")
    factor = raw.get("factor")
    if factor is None and kind == "yarn" and original:  # DeepSeek's form: the ratio is implied
        factor = max_position_embeddings / original
    fields: dict = {"type": kind, "factor": float(factor if factor is not None else 0.0),
              "original_max_position_embeddings": int(original or 0)}
    for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim"):
        if raw.get(name) is not None:
            fields[name] = float(raw[name])
    if raw.get("attention_factor") is not None:
        fields["attention_factor"] = float(raw["attention_factor"])
    if raw.get("truncate") is not None:
        fields["truncate"] = bool(raw["truncate"])
    return RopeScaling(**fields)


def rope_from_gguf(meta: dict, arch: str,
                   frequency_factors: tuple[float, ...] = ()) -> RopeScaling:
    """From a GGUF's `{arch}.rope.scaling.*` keys and its `rope_freqs.weight` tensor's values
    (`frequency_factors`; Llama 3.1's files carry their llama3 scaling only there)."""
    def key(name: str, default=None):
        return meta.get(f"{arch}.rope.scaling.{name}", default)

    kind = key("type", "none")
    if kind in ("none", "default"):
        return RopeScaling(frequency_factors=frequency_factors) if frequency_factors \
            else DEFAULT_ROPE
    fields: dict = {"type": kind, "factor": float(key("factor", 0.0)),
                    "frequency_factors": frequency_factors,
                    "original_max_position_embeddings": int(key("original_context_length", 0))}
    if kind == "yarn":
        if key("yarn_beta_fast") is not None:
            fields["beta_fast"] = float(key("yarn_beta_fast"))
        if key("yarn_beta_slow") is not None:
            fields["beta_slow"] = float(key("yarn_beta_slow"))
        # llama.cpp multiplies its own derived factor (0.1 ln(factor) + 1) by attn_factor
        if key("attn_factor") is not None and float(key("attn_factor")) != 1.0:
            fields["attention_factor"] = float(key("attn_factor")) * yarn_mscale(fields["factor"])
    return RopeScaling(**fields)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (its paper's
    0.1 ln(s) + 1; 1 where nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
