"""Length distributions from short strings: "128", "uniform:64:256", "normal:128:32", "exp:128".

Every draw is an int >= 1 from a caller's random.Random, so a seed fixes the whole workload.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "exp", "lognormal")


@dataclass(frozen=True)
class Dist:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> Dist:
        parts = str(text).split(":")
        if len(parts) == 1:
            return cls("fixed", float(parts[0]))
        kind, *args = parts
        if kind not in KINDS or not 1 <= len(args) <= 2:
            raise ValueError(f"bad distribution {text!r}: N, uniform:LO:HI, normal:MEAN:STD, "
                             "exp:MEAN or lognormal:MEDIAN:SIGMA")
        return cls(kind, *map(float, args))

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "exp":
            x = rng.expovariate(1.0 / self.a)
        else:
            x = rng.lognormvariate(0.0, self.b) * self.a
        return max(1, round(x))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return ":".join([self.kind, f"{self.a:g}"] + ([f"{self.b:g}"] if self.b else []))
