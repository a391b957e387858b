"""Queue depth per priority class, latency percentiles (TTFT, inter-token) and, with the
batch tier, its lines waiting and running."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import QueueView


class QueuePanel(Widget):
    view: reactive[QueueView | None] = reactive(None)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Queue & latency"

    def render(self) -> Table | Text:
        v = self.view
        if v is None:
            return Text("no data yet", style="dim")
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim")
        grid.add_column(justify="right")
        grid.add_column(justify="right")
        classes = "  ".join(f"p{k}:{n}" for k, n in v.by_priority) or "empty"
        grid.add_row("queued", Text(str(v.length), style="bold"), classes)
        grid.add_row("", Text("p50", style="dim"), Text("p99", style="dim"))
        grid.add_row("TTFT", fmt.seconds(v.ttft_p50), fmt.seconds(v.ttft_p99))
        grid.add_row("ITL", fmt.seconds(v.itl_p50), fmt.seconds(v.itl_p99))
        grid.add_row("requests", f"{v.running} run", f"{fmt.count(v.finished)} done")
        if v.batch is not None:  # the idle-capacity tier: its lines apart from online work
            grid.add_row("batch", f"{fmt.count(v.batch.lines_waiting)} wait",
                         f"{v.batch.lines_running} run")
        return grid
