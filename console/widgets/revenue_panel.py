"""Live revenue: last minute and hour, per GPU-hour, the split, margin and a fleet projection;
with the batch tier, its revenue and the utilisation it added."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import RevenueView


def _share(part: float, total: float) -> str:
    return f"{100 * part / total:.0f}%" if total > 0 else "—"


class RevenuePanel(Widget):
    view: reactive[RevenueView | None] = reactive(None)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Revenue"

    def render(self) -> Group | Text:
        v = self.view
        if v is None:
            return Text("no data yet", style="dim")
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim")
        grid.add_column(justify="right")
        grid.add_column(style="dim")
        grid.add_row("last minute", Text(fmt.money(v.last_minute), style="bold"),
                     f"hour {fmt.money(v.last_hour)}")
        grid.add_row("per GPU-hour", Text(fmt.money(v.per_gpu_hour), style="bold"),
                     f"cost {fmt.money(v.gpu_cost_per_hour)}")
        margin_style = "bold red" if v.margin is not None and v.margin < 0 else "bold green"
        grid.add_row("margin", Text(fmt.percent(v.margin), style=margin_style),
                     f"{v.gpus} GPU{'s' if v.gpus != 1 else ''}")
        grid.add_row(f"year @{v.fleet_gpus} GPUs", Text(fmt.money(v.annual), style="bold cyan"),
                     "")
        split = Text()
        for label, part, style in (("hit", v.hit, "green"), ("miss", v.miss, "yellow"),
                                   ("out", v.output, "magenta")):
            split.append(f"{label} ", style="dim")
            split.append(f"{fmt.money(part)} {_share(part, v.total)}  ", style=style)
        if v.batch is None:
            return Group(grid, split)
        b = v.batch
        tier = Text()  # what the idle-capacity tier adds: its revenue and busy time
        tier.append("batch ", style="dim")
        tier.append(f"{fmt.money(b.revenue_batch)} {_share(b.revenue_batch, v.total)}  ",
                    style="cyan")
        tier.append(f"{fmt.money(b.per_gpu_hour_batch)}/GPU-h  ", style="cyan")
        tier.append(f"+{fmt.percent(b.util_batch)} busy", style="bold cyan")
        return Group(grid, split, tier)
