"""Recent requests from the finished spans, newest at the bottom; Enter opens one's waterfall."""
from __future__ import annotations

import time
from dataclasses import dataclass

from textual.message import Message
from textual.widgets import DataTable

from console import fmt
from console.spans import Trace, TraceBook

COLUMNS = ("time", "request", "tenant", "prio", "wkr", "in", "hit", "out", "TTFT", "total",
           "cost", "finish")


def _row(trace: Trace) -> tuple[str, ...]:
    def num(key: str) -> float:
        v = trace.attr(key, 0)
        return float(v) if isinstance(v, (int, float)) else 0.0
    ttft = trace.attr("ttft_s")
    return (time.strftime("%H:%M:%S", time.gmtime(trace.start_ns / 1e9)),
            str(trace.attr("request.id", trace.trace_id[:12]))[-12:],
            str(trace.attr("tenant", "?")), str(trace.attr("priority", "")),
            str(trace.attr("worker", "")), fmt.count(num("gen_ai.usage.input_tokens")),
            fmt.count(num("cached_tokens")), fmt.count(num("gen_ai.usage.output_tokens")),
            fmt.seconds(ttft if isinstance(ttft, (int, float)) else None),
            fmt.seconds((trace.end_ns - trace.start_ns) / 1e9), fmt.money(num("cost.total")),
            str(trace.attr("finish_reason", "…")))


class RequestsTable(DataTable):
    @dataclass
    class Chosen(Message):
        """The operator chose a request: open its span waterfall."""
        trace_id: str

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.border_title = "Recent requests (enter: waterfall)"

    def on_mount(self) -> None:
        for name in COLUMNS:
            self.add_column(name, key=name)

    def show(self, book: TraceBook, touched: list[str]) -> None:
        """Bring the rows in line with the book: update touched traces, drop evicted ones."""
        follow = self.row_count == 0 or self.cursor_row >= self.row_count - 1
        for key in [k.value for k in self.rows if k.value not in book.traces]:
            self.remove_row(key)
        for trace_id in touched:
            trace = book.get(trace_id)
            if trace is None:
                continue
            row = _row(trace)
            if trace_id in self.rows:
                for name, value in zip(COLUMNS, row):
                    self.update_cell(trace_id, name, value)
            else:
                self.add_row(*row, key=trace_id)
        if follow and self.row_count:
            self.move_cursor(row=self.row_count - 1)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.post_message(self.Chosen(event.row_key.value))
