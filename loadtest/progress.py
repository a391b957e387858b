"""A live progress bar with running figures (rich), polling the runner twice a second."""
from __future__ import annotations

import asyncio

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from numeric.percentiles import percentile


def running_line(runner) -> str:
    recs = runner.records
    done = [r for r in recs if r.end > 0]
    ok = [r for r in done if r.ok]
    ttfts = sorted(r.ttft for r in ok[-500:] if r.ttft is not None)
    t = max(runner.now(), 1e-9)
    tokens = sum(r.tokens_arrived for r in ok)
    p = (lambda q: f"{1000 * percentile(ttfts, q):.0f}") if ttfts else (lambda q: "-")
    lag = max((x for _, x in runner.lag.samples[-200:]), default=0.0) * 1000
    return (f"sent {len(recs)}  done {len(done)}  failed {len(done) - len(ok)}  "
            f"in flight {runner.in_flight}  {len(ok) / t:.1f} req/s  {tokens / t:.0f} tok/s  "
            f"TTFT p50/p99 {p(50)}/{p(99)} ms  loop lag {lag:.1f} ms")


async def show_progress(runner, total: float, by_time: bool) -> None:
    """Until cancelled: a bar over time (or over requests) and the running figures."""
    bar = Progress(TextColumn("[bold]load"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                   TimeElapsedColumn())
    task = bar.add_task("run", total=total)
    line = Text("")
    with Live(Group(bar, line), refresh_per_second=4, transient=False) as live:
        try:
            while True:
                await asyncio.sleep(0.5)
                done = runner.now() if by_time else len(runner.records)
                bar.update(task, completed=min(done, total))
                line.plain = running_line(runner)
                live.refresh()
        except asyncio.CancelledError:
            line.plain = running_line(runner)
            live.refresh()
            raise
