"""The top line: model, workers, uptime and the feed's connection state."""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console import fmt
from console.state import HeaderView

STATE_STYLE = {"connected": "bold green", "replaying": "bold cyan", "ended": "bold yellow",
               "connecting": "bold yellow", "disconnected": "bold red"}


class StatusHeader(Widget):
    view: reactive[HeaderView | None] = reactive(None)
    stale_s: reactive[float | None] = reactive(None)
    """Seconds since the last frame, while the feed is connected and silent for long."""

    def render(self) -> Text:
        v = self.view
        text = Text(" inferstack console ", style="bold reverse")
        if v is None:
            return text
        state, _, detail = v.connection.partition(":")
        text.append(f"  {v.model}", style="bold")
        text.append(f"  {v.num_workers} worker{'s' if v.num_workers != 1 else ''}")
        text.append(f"  up {fmt.uptime(v.uptime_s)}")
        text.append("  ● ", style=STATE_STYLE.get(state, "bold"))
        text.append(state, style=STATE_STYLE.get(state, "bold"))
        if detail.strip():
            text.append(f" {detail.strip()}", style="dim")
        if self.stale_s is not None:
            text.append(f"  silent {self.stale_s:.0f}s", style="bold red")
        if v.num_malformed:
            text.append(f"  {v.num_malformed} malformed", style="yellow")
        if v.paused:
            text.append("  PAUSED ", style="bold reverse yellow")
        return text
