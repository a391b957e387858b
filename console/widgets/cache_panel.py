"""The prefix cache: hit rate now and over time, hit and miss tokens."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import CacheView


class CachePanel(Widget):
    view: reactive[CacheView | None] = reactive(None)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Prefix cache"

    def render(self) -> Group | Text:
        v = self.view
        if v is None:
            return Text("no data yet", style="dim")
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim")
        grid.add_column(justify="right")
        grid.add_row("hit rate, last min", Text(fmt.percent(v.hit_rate_last_minute),
                                                style="bold green"))
        grid.add_row("hit rate, all", fmt.percent(v.hit_rate))
        grid.add_row("hit tokens", fmt.count(v.hit_tokens))
        grid.add_row("miss tokens", fmt.count(v.miss_tokens))
        width = max(self.size.width, 8)
        spark = Text(fmt.sparkline(v.history, width, 0.0, 1.0), style="green")
        return Group(grid, spark)
