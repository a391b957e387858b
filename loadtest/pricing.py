"""Price books and per-request cost: the server's reported cost when present, else local prices.

Each request's input is split into cache-hit tokens (usage.prompt_tokens_details.cached_tokens)
and cache-miss tokens (the rest of prompt_tokens); output tokens are completion_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

PRESETS = {  # $ per million tokens: cache-hit input, cache-miss input, output
    "seed": (0.003, 0.15, 0.60),
    "deepseek-v3": (0.07, 0.27, 1.10),
    "deepseek-r1": (0.14, 0.55, 2.19),
}


@dataclass(frozen=True)
class PriceBook:
    name: str
    hit_per_m: float
    miss_per_m: float
    output_per_m: float
    use_reported: bool = True  # False: price every request locally, ignoring usage.cost

    @classmethod
    def preset(cls, name: str, use_reported: bool = True) -> PriceBook:
        if name not in PRESETS:
            raise ValueError(f"unknown price book {name!r}: one of {', '.join(PRESETS)}")
        return cls(name, *PRESETS[name], use_reported)

    def cost(self, cached: int, prompt: int, completion: int) -> dict:
        hit = cached * self.hit_per_m / 1e6
        miss = max(0, prompt - cached) * self.miss_per_m / 1e6
        out = completion * self.output_per_m / 1e6
        return {"cache_hit_input": hit, "cache_miss_input": miss, "output": out,
                "total": hit + miss + out}


def request_cost(usage: dict | None, book: PriceBook,
                 use_reported: bool = True) -> tuple[dict | None, str]:
    """(cost dict, source) for one request's usage: source is "reported" or "price_book"."""
    if not usage:
        return None, "none"
    reported = usage.get("cost") if use_reported else None
    if isinstance(reported, dict) and isinstance(reported.get("total"), (int, float)):
        keys = ("cache_hit_input", "cache_miss_input", "output", "total")
        return {k: float(reported.get(k) or 0.0) for k in keys}, "reported"
    return book.cost(cached_tokens(usage), int(usage.get("prompt_tokens") or 0),
                     int(usage.get("completion_tokens") or 0)), "price_book"


def cached_tokens(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
