"""`python -m billing.economics`: revenue, cost, margin and revenue per GPU-hour.

From a ledger, from given token counts and prices, or (`--deepseek-published`) from the inputs
DeepSeek published for one day of V3/R1 serving (Feb 2025), set beside their published results.
Every figure is computed from its inputs; the published results are only compared against.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

from billing.pricing import PRESETS, PriceBook

HOURS_PER_YEAR = 24 * 365

# DeepSeek's inference-system overview, day of 2025-02-27/28: the inputs ...
DEEPSEEK_DAY: dict[str, Any] = {
    "input_tokens": 608e9, "cache_hit_tokens": 342e9, "output_tokens": 168e9,
    "nodes": 226.75, "gpus_per_node": 8, "gpu_cost_per_hour": 2.0, "hours": 24,
    "prices": "deepseek-r1"}
# ... and the results they reported, which we compare against and never use as inputs.
DEEPSEEK_PUBLISHED = {"revenue": 562_027.0, "cost": 87_072.0, "margin": 5.45}


@dataclass(frozen=True)
class Economics:
    cache_hit_tokens: float
    cache_miss_tokens: float
    output_tokens: float
    gpu_hours: float
    revenue_hit: float
    revenue_miss: float
    revenue_output: float
    cost: float

    @property
    def revenue(self) -> float:
        return self.revenue_hit + self.revenue_miss + self.revenue_output

    @property
    def margin(self) -> float:
        """Cost-profit margin: profit over cost (DeepSeek's 545%)."""
        return (self.revenue - self.cost) / self.cost if self.cost else float("inf")

    @property
    def revenue_per_gpu_hour(self) -> float:
        return self.revenue / self.gpu_hours if self.gpu_hours else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.cache_hit_tokens + self.cache_miss_tokens
        return self.cache_hit_tokens / total if total else 0.0

    def annual_revenue(self, gpus: int) -> float:
        return self.revenue_per_gpu_hour * gpus * HOURS_PER_YEAR


def compute(hit: float, miss: float, output: float, prices: PriceBook,
            gpu_hours: float) -> Economics:
    c = prices.cost(hit, miss, output)
    return Economics(hit, miss, output, gpu_hours, c.cache_hit_input, c.cache_miss_input,
                     c.output, gpu_hours * prices.gpu_cost_per_hour)


def deepseek_day() -> Economics:
    d = DEEPSEEK_DAY
    prices = PriceBook.preset(d["prices"], gpu_cost_per_hour=d["gpu_cost_per_hour"])
    gpu_hours = d["nodes"] * d["gpus_per_node"] * d["hours"]
    return compute(d["cache_hit_tokens"], d["input_tokens"] - d["cache_hit_tokens"],
                   d["output_tokens"], prices, gpu_hours)


def from_ledger(path: str, prices: PriceBook, gpus: int, since: float | None,
                until: float | None) -> tuple[Economics, float]:
    """Token totals and billed revenue from a ledger; GPU-hours are the window times gpus."""
    import sqlite3
    db = sqlite3.connect(path)
    where, args = "1=1", list[float]()
    if since is not None:
        where, args = where + " AND created >= ?", args + [since]
    if until is not None:
        where, args = where + " AND created < ?", args + [until]
    row = db.execute(f"SELECT COALESCE(SUM(cache_hit_tokens),0), COALESCE(SUM(cache_miss_tokens),"
                     f"0), COALESCE(SUM(output_tokens),0), COALESCE(SUM(cost_total),0), "
                     f"MIN(created), MAX(finished) FROM requests WHERE {where}", args).fetchone()
    db.close()
    hit, miss, out, billed, first, last = row
    start = since if since is not None else (first or time.time())
    end = until if until is not None else (last or start)
    hours = max(end - start, 1e-9) / 3600
    return compute(hit, miss, out, prices, hours * gpus), billed


def render(e: Economics, gpus: int, published: dict | None = None) -> str:
    rows = [("cache-hit input tokens", f"{e.cache_hit_tokens:,.0f}"),
            ("cache-miss input tokens", f"{e.cache_miss_tokens:,.0f}"),
            ("output tokens", f"{e.output_tokens:,.0f}"),
            ("cache hit rate (input)", f"{e.hit_rate:.1%}"),
            ("GPU-hours", f"{e.gpu_hours:,.2f}"),
            ("revenue: cache-hit input", f"${e.revenue_hit:,.2f}"),
            ("revenue: cache-miss input", f"${e.revenue_miss:,.2f}"),
            ("revenue: output", f"${e.revenue_output:,.2f}"),
            ("revenue", f"${e.revenue:,.2f}"),
            ("cost (GPU-hours x price)", f"${e.cost:,.2f}"),
            ("cost-profit margin", f"{e.margin:.0%}"),
            ("revenue per GPU-hour", f"${e.revenue_per_gpu_hour:,.2f}"),
            (f"annual revenue, {gpus} GPUs", f"${e.annual_revenue(gpus):,.0f}")]
    if published:
        rows += [("published revenue", f"${published['revenue']:,.0f} (ours differs by "
                                       f"{(e.revenue / published['revenue'] - 1):+.3%})"),
                 ("published cost", f"${published['cost']:,.0f} (ours differs by "
                                    f"{(e.cost / published['cost'] - 1):+.3%})"),
                 ("published margin", f"{published['margin']:.0%}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m billing.economics", description=__doc__)
    p.add_argument("--deepseek-published", action="store_true",
                   help="recompute DeepSeek's published day from its inputs")
    p.add_argument("--ledger", help="a gateway ledger (SQLite) to total")
    p.add_argument("--since", type=float, help="ledger window start, unix seconds")
    p.add_argument("--until", type=float, help="ledger window end, unix seconds")
    p.add_argument("--hit-tokens", type=float, default=0)
    p.add_argument("--miss-tokens", type=float, default=0)
    p.add_argument("--output-tokens", type=float, default=0)
    p.add_argument("--gpu-hours", type=float, default=24.0,
                   help="GPU-hours behind the given token counts")
    p.add_argument("--prices", default="seed",
                   help=f"a preset ({', '.join(PRESETS)}) or a price-book TOML")
    p.add_argument("--gpu-cost-per-hour", type=float, default=None)
    p.add_argument("--gpus", type=int, default=128, help="fleet size for the annual figure")
    args = p.parse_args(argv)
    if args.deepseek_published:
        print(render(deepseek_day(), args.gpus, DEEPSEEK_PUBLISHED))
        return 0
    prices = PriceBook.load(args.prices)
    if args.gpu_cost_per_hour is not None:
        prices = dataclasses.replace(prices, gpu_cost_per_hour=args.gpu_cost_per_hour)
    if args.ledger:
        e, billed = from_ledger(args.ledger, prices, args.gpus, args.since, args.until)
        print(render(e, args.gpus))
        print(f"billed in the ledger (with time-of-day multipliers): ${billed:,.6f}")
        return 0
    print(render(compute(args.hit_tokens, args.miss_tokens, args.output_tokens, prices,
                         args.gpu_hours), args.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
