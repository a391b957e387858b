"""A small dialog asking for the fleet size of the annual revenue projection."""
from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class FleetScreen(ModalScreen[int | None]):
    """Dismisses with the new GPU count, or None when cancelled."""
    BINDINGS: ClassVar = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: int):
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="fleet-dialog"):
            yield Label("Fleet size (GPUs) for the annual projection; enter to apply")
            yield Input(str(self.current), type="integer", id="fleet-input")
            yield Label("", id="fleet-error")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        try:
            value = int(event.value)
        except ValueError:
            value = 0
        if value < 1:
            self.query_one("#fleet-error", Label).update("a whole number of GPUs, 1 or more")
            return
        self.dismiss(value)
