"""The fleet: every live gateway (from the registry in Redis), its workers and load, and the
fleet's revenue and cache-hit rate from the ledger. Hidden until a feed carries a fleet."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import FleetView


class FleetPanel(Widget):
    view: reactive[FleetView | None] = reactive(None, layout=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Fleet"
        self.display = False

    def watch_view(self, view: FleetView | None) -> None:
        self.display = view is not None  # a gateway without --redis-url has no fleet

    def render(self) -> Group | Text:
        v = self.view
        if v is None:
            return Text("")
        table = Table(box=None, padding=(0, 1), header_style="bold")
        table.add_column("gateway", no_wrap=True)
        for name in ("workers", "draining", "run", "queue", "load", "beat"):
            table.add_column(name, justify="right", no_wrap=True)
        for g in v.gateways:
            address = Text(g.address, style="bold" if g.is_self else "")
            if g.is_self:
                address.append(" (this)", style="dim")
            workers = Text(f"{g.alive}/{g.workers}",
                           style="" if g.alive == g.workers else "bold red")
            table.add_row(address, workers, str(g.draining), str(g.running), str(g.queue),
                          fmt.percent(g.load), fmt.seconds(g.heartbeat_age_s))
        summary = Text()
        summary.append(f"{len(v.gateways)} gateways, {v.workers} workers", style="dim")
        if v.revenue is not None:
            summary.append(f"   revenue {fmt.money(v.revenue)}", style="bold")
            summary.append(f" over {v.requests} requests, cache hit {fmt.percent(v.hit_rate)}",
                           style="dim")
        return Group(table, summary)
