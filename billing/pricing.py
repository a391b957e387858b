"""The price book: dollars per million cache-hit input, cache-miss input and output tokens,
time-of-day multipliers (off-peak discounts) and the GPU cost per hour.

TOML (every field optional; `preset` fills the three prices):
    preset = "seed"                 # seed | deepseek-v3 | deepseek-r1
    cache_hit_input = 0.003         # $ per million tokens
    cache_miss_input = 0.15
    output = 0.60
    gpu_cost_per_hour = 2.0
    batch_multiplier = 0.5          # Batch API lines: on top of the window's multiplier
    [[windows]]                     # UTC; may wrap past midnight
    start = "16:30"
    end = "00:30"
    multiplier = 0.5
"""
from __future__ import annotations

import datetime as dt
import tomllib
from dataclasses import dataclass, field

PRESETS = {  # $ per million tokens: (cache-hit input, cache-miss input, output)
    "seed": (0.003, 0.15, 0.60),
    "deepseek-v3": (0.07, 0.27, 1.10),
    "deepseek-r1": (0.14, 0.55, 2.19),
}


# who a request is served for: "online" (an API call waiting for its answer) or "batch" (a
# line of a Batch API job, run in idle capacity)
TIERS = ("online", "batch")


class PriceBookError(ValueError):
    pass


@dataclass(frozen=True)
class PriceWindow:
    start_minute: int  # minutes after midnight UTC
    end_minute: int
    multiplier: float

    def contains(self, minute: int) -> bool:
        if self.start_minute <= self.end_minute:
            return self.start_minute <= minute < self.end_minute
        return minute >= self.start_minute or minute < self.end_minute  # wraps midnight


@dataclass(frozen=True)
class Cost:
    cache_hit_input: float
    cache_miss_input: float
    output: float

    @property
    def total(self) -> float:
        return self.cache_hit_input + self.cache_miss_input + self.output

    def as_dict(self) -> dict:
        return {"cache_hit_input": self.cache_hit_input, "cache_miss_input": self.cache_miss_input,
                "output": self.output, "total": self.total, "currency": "USD"}

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.cache_hit_input + other.cache_hit_input,
                    self.cache_miss_input + other.cache_miss_input, self.output + other.output)


ZERO_COST = Cost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class PriceBook:
    cache_hit_input: float  # $ per million tokens
    cache_miss_input: float
    output: float
    gpu_cost_per_hour: float = 2.0
    windows: tuple[PriceWindow, ...] = field(default_factory=tuple)
    name: str = "custom"
    # batch-tier lines run in idle capacity and are sold at this fraction of the price in
    # force (OpenAI's Batch API: half price)
    batch_multiplier: float = 0.5

    @classmethod
    def preset(cls, name: str, gpu_cost_per_hour: float = 2.0) -> PriceBook:
        if name not in PRESETS:
            raise PriceBookError(f"unknown price preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(*PRESETS[name], gpu_cost_per_hour=gpu_cost_per_hour, name=name)

    @classmethod
    def load(cls, spec: str) -> PriceBook:
        """A preset's name (seed | deepseek-v3 | deepseek-r1) or the path of a price-book TOML."""
        return cls.preset(spec) if spec in PRESETS else cls.from_toml(spec)

    @classmethod
    def from_toml(cls, path: str) -> PriceBook:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise PriceBookError(f"{path}: {exc}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "price book") -> PriceBook:
        hit, miss, out = PRESETS.get(data.get("preset", "seed"), (None, None, None))
        if "preset" in data and data["preset"] not in PRESETS:
            raise PriceBookError(f"{where}: unknown preset {data['preset']!r}")
        values = {"cache_hit_input": data.get("cache_hit_input", hit),
                  "cache_miss_input": data.get("cache_miss_input", miss),
                  "output": data.get("output", out),
                  "gpu_cost_per_hour": data.get("gpu_cost_per_hour", 2.0),
                  "batch_multiplier": data.get("batch_multiplier", 0.5)}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise PriceBookError(f"{where}: {k} must be a non-negative number, got {v!r}")
        windows = tuple(_window(w, where) for w in data.get("windows", []))
        return cls(**{k: float(v) for k, v in values.items()}, windows=windows,
                   name=data.get("preset", "custom"))

    def multiplier(self, when: dt.datetime | None = None, tier: str = "online") -> float:
        """The price multiplier in force: the time-of-day window's, times the batch
        multiplier for a batch-tier request."""
        if tier not in TIERS:
            raise PriceBookError(f"unknown tier {tier!r}; choose from {TIERS}")
        when = when or dt.datetime.now(dt.UTC)
        minute = when.hour * 60 + when.minute
        window = next((w.multiplier for w in self.windows if w.contains(minute)), 1.0)
        return window * self.batch_multiplier if tier == "batch" else window

    def cost(self, hit_tokens: float, miss_tokens: float, output_tokens: float,
             multiplier: float = 1.0) -> Cost:
        m = multiplier / 1e6
        return Cost(hit_tokens * self.cache_hit_input * m, miss_tokens * self.cache_miss_input * m,
                    output_tokens * self.output * m)

    def as_dict(self) -> dict:
        return {"name": self.name, "cache_hit_input": self.cache_hit_input,
                "cache_miss_input": self.cache_miss_input, "output": self.output,
                "gpu_cost_per_hour": self.gpu_cost_per_hour,
                "batch_multiplier": self.batch_multiplier,
                "windows": [{"start_minute": w.start_minute, "end_minute": w.end_minute,
                             "multiplier": w.multiplier} for w in self.windows]}


def _window(w: dict, where: str) -> PriceWindow:
    try:
        start, end, mult = _minute(w["start"]), _minute(w["end"]), float(w["multiplier"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PriceBookError(f"{where}: a window needs start and end as 'HH:MM' and a "
                             f"multiplier ({exc})") from None
    if mult < 0:
        raise PriceBookError(f"{where}: a window's multiplier must be >= 0")
    return PriceWindow(start, end, mult)


def _minute(text: str) -> int:
    hours, minutes = text.split(":")
    h, m = int(hours), int(minutes)
    if not (0 <= h < 24 and 0 <= m < 60):
        raise ValueError(f"{text!r} is not a time of day")
    return h * 60 + m
