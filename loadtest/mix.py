"""Weighted mixes of tenants (API keys) and priority classes.

`--tenants "gold=sk-a:3,free=sk-b:1"`: name=key:weight; `--priorities "0:1,2:4"`: class:weight.
A request draws its tenant and class from the seeded generator; a trace line may name both.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str | None
    weight: float = 1.0


def parse_tenants(text: str | None, default_key: str | None) -> list[Tenant]:
    if not text:
        return [Tenant("default", default_key)]
    tenants = []
    for part in text.split(","):
        name, _, rest = part.partition("=")
        key, _, weight = rest.rpartition(":") if ":" in rest else (rest, "", "1")
        if not name or not key:
            raise ValueError(f"bad tenant {part!r}: use NAME=KEY[:WEIGHT]")
        tenants.append(Tenant(name.strip(), key, float(weight or 1)))
    return tenants


def parse_priorities(text: str | None) -> list[tuple[int | None, float]]:
    """[(class, weight)]; [(None, 1)] sends no priority field at all (any server accepts)."""
    if not text:
        return [(None, 1.0)]
    out = []
    for part in text.split(","):
        cls, _, weight = part.partition(":")
        out.append((int(cls), float(weight or 1)))
    return out


class Mix:
    def __init__(self, tenants: list[Tenant], priorities: list[tuple[int | None, float]]):
        self.tenants = tenants
        self.priorities = priorities
        self.by_name = {t.name: t for t in tenants}

    @classmethod
    def default(cls, api_key: str | None = None) -> Mix:
        return cls(parse_tenants(None, api_key), parse_priorities(None))

    def draw(self, rng: random.Random) -> tuple[Tenant, int | None]:
        tenant = rng.choices(self.tenants, [t.weight for t in self.tenants])[0]
        prio = rng.choices([p for p, _ in self.priorities], [w for _, w in self.priorities])[0]
        return tenant, prio

    def tenant(self, name: str | None, default_key: str | None) -> Tenant:
        if name is None:
            return self.tenants[0]
        return self.by_name.get(name) or Tenant(name, default_key)
