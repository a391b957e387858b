"""One row per GPU or CPU worker: utilisation and its sparkline, memory, KV cache, load."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import WorkerView

FIXED_COLUMNS_WIDTH = 74  # everything but the sparkline, padding included


class WorkerTable(Widget):
    views: reactive[tuple[WorkerView, ...]] = reactive((), layout=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "Workers"

    def render(self) -> Table:
        spark_width = max(8, min(60, self.size.width - FIXED_COLUMNS_WIDTH))
        table = Table(box=None, padding=(0, 1), header_style="bold")
        table.add_column("#", justify="right")
        table.add_column("device")
        table.add_column("util", justify="right")
        table.add_column("history", no_wrap=True, width=spark_width)
        table.add_column("mem GiB", justify="right")
        table.add_column("KV", justify="right")
        table.add_column("run", justify="right")
        table.add_column("wait", justify="right")
        table.add_column("tok/s", justify="right")
        for w in self.views:
            device = Text(w.device if w.alive else f"{w.device} down",
                          style="" if w.alive else "bold red")
            if w.restarts:
                device.append(f" ↻{w.restarts}", style="yellow")
            mem = (f"{fmt.gib(w.memory_used)}/{fmt.gib(w.memory_total)}" if w.memory_total
                   else f"cpu {w.cpu_percent:.0f}%")
            table.add_row(str(w.index), device, fmt.percent(w.utilisation),
                          Text(fmt.sparkline(w.util_history, spark_width, 0.0, 1.0),
                               style="green"),
                          mem, f"{100 * w.kv_usage:.0f}% {w.kv_blocks_used}/{w.kv_blocks_total}",
                          str(w.running), str(w.waiting), f"{w.tokens_per_s:.1f}")
        if not self.views:
            table.add_row("", Text("waiting for the first snapshot…", style="dim"))
        return table
