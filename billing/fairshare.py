"""Fair share across tenants within a priority class: start-time fair queuing.

Each tenant has a virtual clock in seconds. A request's virtual start is max(now, the tenant's
clock), and the clock then advances by the request's tokens / (weight * nominal rate). The
queue orders a class by virtual start, so a tenant that bursts pushes only its own requests
into the future, and over a busy period tenants are served tokens in proportion to weight.
The estimate taken at admission is corrected by the tokens really served.
"""
from __future__ import annotations

import time


class FairShare:
    def __init__(self, tokens_per_second: float = 1000.0, clock=time.monotonic):
        self.tokens_per_second = tokens_per_second
        self.clock = clock
        self.virtual: dict[str, float] = {}

    def start(self, tenant: str, weight: float, tokens: int) -> float:
        """Virtual start time of a new request, and advance the tenant's clock."""
        begin = max(self.clock(), self.virtual.get(tenant, 0.0))
        self.virtual[tenant] = begin + tokens / (weight * self.tokens_per_second)
        return begin

    def correct(self, tenant: str, weight: float, estimated: int, actual: int) -> None:
        """Charge the tokens really served instead of the admission estimate."""
        if tenant in self.virtual:
            delta = (actual - estimated) / (weight * self.tokens_per_second)
            self.virtual[tenant] = max(self.clock(), self.virtual[tenant] + delta) \
                if delta < 0 else self.virtual[tenant] + delta
