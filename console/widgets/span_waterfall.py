"""One request's spans as bars on a shared time axis (root first, then children by start)."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.spans import Trace

SPAN_STYLE = {"llm.request": "bold blue", "queue": "yellow", "prefill": "magenta",
              "decode": "green"}
LABEL_WIDTH = 34  # name + offset + duration columns


def bar(start: float, end: float, width: int) -> Text:
    """A bar from fraction `start` to `end` of `width` cells (at least one cell)."""
    a = min(int(start * width), width - 1)
    b = max(a + 1, min(round(end * width), width))
    return Text(" " * a + "█" * (b - a) + " " * (width - b))


class SpanWaterfall(Widget):
    trace: reactive[Trace | None] = reactive(None, layout=True)

    def render(self) -> Table | Text:
        trace = self.trace
        if trace is None or not trace.spans:
            return Text("no spans", style="dim")
        t0, t1 = trace.start_ns, trace.end_ns
        total = max(t1 - t0, 1)
        width = max(self.size.width - LABEL_WIDTH, 10)
        table = Table(box=None, padding=(0, 1), header_style="bold", expand=True)
        table.add_column("span", no_wrap=True)
        table.add_column("start", justify="right")
        table.add_column("dur", justify="right")
        table.add_column(f"0 … {fmt.seconds(total / 1e9)}", no_wrap=True, width=width)
        for span in trace.ordered():
            style = SPAN_STYLE.get(span.name, "cyan")
            name = span.name if not span.parent_id else f"  {span.name}"
            bar_text = bar((span.start_ns - t0) / total, (span.end_ns - t0) / total, width)
            bar_text.stylize(style)
            table.add_row(Text(name, style=style), fmt.seconds((span.start_ns - t0) / 1e9),
                          fmt.seconds(span.duration_s), bar_text)
        return table
