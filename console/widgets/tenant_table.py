"""Tenants: requests, tokens (hit, miss, output) and spend, biggest spender first."""
from __future__ import annotations

from rich.table import Table
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import TenantView


class TenantTable(Widget):
    views: reactive[tuple[TenantView, ...]] = reactive((), layout=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Tenants"

    def render(self) -> Table:
        table = Table(box=None, expand=True, padding=(0, 1), header_style="bold")
        table.add_column("tenant", no_wrap=True, overflow="ellipsis", ratio=1)
        for name in ("reqs", "hit", "miss", "out", "spend"):
            table.add_column(name, justify="right", no_wrap=True)
        for t in self.views:
            table.add_row(t.tenant, fmt.count(t.requests), fmt.count(t.hit_tokens),
                          fmt.count(t.miss_tokens), fmt.count(t.output_tokens), fmt.money(t.spend))
        return table
