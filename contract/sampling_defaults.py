"""The sampling a model gets for the fields a request leaves out.

OpenAI's defaults (temperature 1, no top-p, top-k or min-p) suit large models; a small one
sampled that way rambles. So, like vLLM, a Hugging Face folder's `generation_config.json`
supplies the defaults; a GGUF file carries them in `general.sampling.*` metadata when its
maker wrote any, and otherwise gets the documented profile `GGUF_PROFILE`. An operator picks
another with `--sampling-defaults` (`parse_spec`). Only omitted fields take a default: a
request that sends `temperature` gets exactly that.

No torch here: the gateway imports it to check `--sampling-defaults` before workers start; a
worker reads its model's own defaults with runtime/loading/sampling_defaults.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from contract.errors import InvalidRequestError
from contract.sampling_params import SamplingParams

# the fields a default may fill, and their types
FIELDS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                           "repetition_penalty": float}

PROFILES: dict[str, dict[str, float | int]] = {
    # OpenAI's own: temperature 1 and nothing else (what a request got before defaults)
    "openai": {},
    # llama.cpp's server
    "llama-cpp": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    # the most likely token each step: reproducible, and what a very small model needs
    "greedy": {"temperature": 0.0},
}
GGUF_PROFILE = "greedy"  # for GGUF files that name no sampling of their own

# GGUF metadata keys (llama.cpp's `general.sampling.*`) and the fields they fill
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingSpec:
    """`--sampling-defaults` parsed: a base ("model", or a profile name) and overrides."""

    base: str = "model"
    overrides: Mapping[str, float | int] = field(default_factory=dict)

    def resolve(self, model_defaults: Mapping[str, float | int]) -> dict[str, float | int]:
        base = dict(model_defaults) if self.base == "model" else dict(PROFILES[self.base])
        base.update(self.overrides)
        return base


def parse_spec(text: str | None) -> SamplingSpec:
    """"model" (or empty), "none" (= openai), a profile name, or KEY=VALUE,... over "model";
    a profile may start the list: "llama-cpp,temperature=0.6". ValueError names what is bad."""
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    base = "model"
    if parts and "=" not in parts[0]:
        base = parts.pop(0)
        base = "openai" if base == "none" else base
        if base != "model" and base not in PROFILES:
            raise ValueError(f"unknown sampling profile {base!r}; choose model, none or one of "
                             f"{', '.join(PROFILES)}")
    overrides: dict[str, float | int] = {}
    for part in parts:
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in FIELDS:
            raise ValueError(f"{name!r} is not a sampling default; use {', '.join(FIELDS)}")
        try:
            overrides[name] = FIELDS[name](value.strip())
        except ValueError:
            raise ValueError(f"{name}={value.strip()!r} is not a number") from None
    check(overrides)
    return SamplingSpec(base, overrides)


def check(defaults: Mapping[str, float | int]) -> None:
    """The values the runtime's own validation accepts; ValueError names the bad one."""
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None
