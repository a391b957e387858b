"""Service-level objectives: per-request latency limits, and goodput (requests meeting all).

`--slo ttft:500,tpot:50,e2e:10000` (milliseconds). A request is "good" when it succeeded and
every limit given holds for it: its TTFT, its TPOT (0 for a one-token reply, as in DistServe),
its largest per-token inter-token latency (`itl`, the worst stall) and its end-to-end latency.
"""
from __future__ import annotations

from dataclasses import dataclass

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None  # applies to the request's largest per-token gap
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        if not text:
            return cls()
        limits = {}
        for part in text.split(","):
            name, _, value = part.partition(":")
            name = name.strip().lower()
            if name not in METRICS or not value:
                raise ValueError(f"bad SLO term {part!r}: use {'|'.join(METRICS)}:<ms>")
            limits[name + "_ms"] = float(value)
        return cls(**limits)

    def is_empty(self) -> bool:
        return all(getattr(self, m + "_ms") is None for m in METRICS)

    def as_dict(self) -> dict:
        return {m + "_ms": getattr(self, m + "_ms") for m in METRICS}

    def met_by(self, rec) -> bool:
        """Did the finished request `rec` (a RequestRecord) succeed within every limit?"""
        if not rec.ok:
            return False
        observed = {"ttft": rec.ttft, "tpot": rec.tpot, "itl": rec.max_itl, "e2e": rec.e2e}
        for m in METRICS:
            limit = getattr(self, m + "_ms")
            if limit is None:
                continue
            value = observed[m]
            if value is None or value * 1000.0 > limit:
                return False
        return True
