"""Per-tenant token buckets: requests per minute and tokens per minute."""
from __future__ import annotations

import math
import time


class TokenBucket:
    """Holds up to `capacity`; refills at `rate_per_minute`. A rate of 0 means unlimited."""

    def __init__(self, rate_per_minute: float, clock=time.monotonic):
        self.rate = rate_per_minute / 60.0
        self.capacity = rate_per_minute
        self.level = rate_per_minute
        self.clock = clock
        self.updated = clock()

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_seconds(self, amount: float) -> float:
        """0 if `amount` can be taken now, else seconds until it can (inf if never)."""
        if self.unlimited:
            return 0.0
        self._refill()
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        if not self.unlimited:
            self._refill()
            self.level -= amount

    def give_back(self, amount: float) -> None:
        if not self.unlimited and amount > 0:
            self._refill()
            self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}

    def buckets(self, tenant) -> tuple[TokenBucket, TokenBucket]:
        pair = self._buckets.get(tenant.name)
        # a reloaded key file may change the limits: new limits start a fresh pair
        if pair is None or (pair[0].capacity, pair[1].capacity) != (
                tenant.requests_per_minute, tenant.tokens_per_minute):
            pair = (TokenBucket(tenant.requests_per_minute, self.clock),
                    TokenBucket(tenant.tokens_per_minute, self.clock))
            self._buckets[tenant.name] = pair
        return pair

    def take_request(self, tenant) -> float:
        """Charge one request before any work is done for it (0), or the seconds to wait.
        It is never refunded: a request refused later still cost us its parsing."""
        return _take(self.buckets(tenant)[0], 1)

    def take_tokens(self, tenant, tokens: int) -> float:
        """Charge a counted request's tokens (0), or the seconds to wait (inf: never fits)."""
        return _take(self.buckets(tenant)[1], tokens)

    def refund(self, tenant, tokens: int) -> None:
        """Return tokens charged but not used (a request ended below its maximum)."""
        self.buckets(tenant)[1].give_back(tokens)


def _take(bucket: TokenBucket, amount: float) -> float:
    wait = bucket.wait_seconds(amount)
    if wait == 0:
        bucket.take(amount)
    return wait
