"""A request's span waterfall, with its root span's attributes underneath."""
from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from console import fmt
from console.spans import Trace
from console.widgets.span_waterfall import SpanWaterfall


def attribute_table(trace: Trace) -> Table:
    table = Table(box=None, padding=(0, 1), show_header=False)
    table.add_column(style="dim")
    table.add_column()
    root = trace.root
    attrs = dict(sorted(root.attributes.items())) if root else {}
    for key, value in attrs.items():
        if key.startswith("cost.") and isinstance(value, (int, float)):
            text = fmt.money(value)
        elif key.endswith("_s") and isinstance(value, (int, float)):
            text = fmt.seconds(value)
        else:
            text = f"{value:.6g}" if isinstance(value, float) else str(value)
        table.add_row(key, text)
    return table


class WaterfallScreen(Screen[None]):
    BINDINGS: ClassVar = [Binding("escape,q", "app.pop_screen", "Back")]

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def compose(self) -> ComposeResult:
        title = f"request {self.trace.attr('request.id', '?')}  trace {self.trace.trace_id}"
        with VerticalScroll(id="waterfall-body"):
            waterfall = SpanWaterfall(id="waterfall")
            waterfall.border_title = title
            yield waterfall
            attrs = Static(attribute_table(self.trace), id="span-attributes")
            attrs.border_title = "Attributes"
            yield attrs
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(SpanWaterfall).trace = self.trace
