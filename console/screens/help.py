"""The help screen: what each panel shows and the key bindings."""
from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# Operator console

Live view of one gateway's telemetry feed (`GET /admin/telemetry`).

| key | action |
| --- | --- |
| `p` | pause / resume the display (the feed is still read and recorded) |
| `f` | set the fleet size used for the annual revenue projection |
| `enter` | open the span waterfall of the chosen request |
| `tab` | move between the requests table and the rest |
| `?` | this help |
| `escape` | close a screen |
| `q` | quit |

**Revenue**: margin = (revenue per GPU-hour - GPU cost per hour) / GPU cost per hour;
the annual projection is revenue per GPU-hour x fleet size x 8760 hours.

**Cache**: the hit rate over the last minute, its history (sparkline) and all-time tokens.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Markdown(HELP)
