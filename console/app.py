"""The console App: reads one feed source in a worker and pushes views down to the widgets."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer

from console.feed import Event, Frame, Malformed, Status
from console.screens.fleet import FleetScreen
from console.screens.help import HelpScreen
from console.screens.waterfall import WaterfallScreen
from console.state import ConsoleState
from console.widgets.cache_panel import CachePanel
from console.widgets.fleet_panel import FleetPanel
from console.widgets.queue_panel import QueuePanel
from console.widgets.requests_table import RequestsTable
from console.widgets.revenue_panel import RevenuePanel
from console.widgets.status_header import StatusHeader
from console.widgets.tenant_table import TenantTable
from console.widgets.worker_table import WorkerTable

STALE_AFTER_S = 3.0  # a connected feed silent this long is flagged in the header


class Source(Protocol):
    def events(self): ...


@dataclass
class FeedEvent(Message):
    """One event from the feed worker, handed to the app's message loop."""
    event: Event


class ConsoleApp(App[None]):
    CSS_PATH = Path(__file__).with_name("console.tcss")
    TITLE = "inferstack console"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS: ClassVar = [
        Binding("p", "toggle_pause", "Pause"),
        Binding("f", "fleet", "Fleet size"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, source: Source, fleet_gpus: int = 128,
                 now: Callable[[], float] = time.time, max_requests: int = 200):
        super().__init__()
        self.source = source
        self.now = now
        self.state = ConsoleState(fleet_gpus=fleet_gpus, max_requests=max_requests)
        self._push_pending = False

    def compose(self) -> ComposeResult:
        yield StatusHeader()
        with VerticalScroll(id="dashboard"):
            yield WorkerTable()
            yield FleetPanel()
            with Horizontal(id="panels"):
                yield CachePanel()
                yield QueuePanel()
                yield RevenuePanel()
            with Horizontal(id="lower"):
                yield RequestsTable()
                yield TenantTable()
        yield Footer()

    def on_mount(self) -> None:
        self.push_views()
        self.read_feed()
        self.set_interval(1.0, self.check_stale)

    @work(exclusive=True, group="feed")
    async def read_feed(self) -> None:
        async for event in self.source.events():
            self.post_message(FeedEvent(event))

    # feed → state → views

    def on_feed_event(self, message: FeedEvent) -> None:
        event = message.event
        if isinstance(event, Frame):
            self.state.apply(event.data, received_at=self.now())
        elif isinstance(event, Status):
            self.state.connection = f"{event.state}: {event.detail}" if event.detail \
                else event.state
        elif isinstance(event, Malformed):
            self.state.num_malformed += 1
        if not self._push_pending:  # one push for a burst of frames already queued
            self._push_pending = True
            self.call_later(self.push_views)

    def push_views(self) -> None:
        """Attributes down: each widget gets the frozen view it draws."""
        self._push_pending = False
        state = self.state
        self.query_one(StatusHeader).view = state.header_view()
        if state.paused:
            return
        self.query_one(WorkerTable).views = state.worker_views()
        self.query_one(FleetPanel).view = state.fleet_view()
        self.query_one(CachePanel).view = state.cache_view()
        self.query_one(RevenuePanel).view = state.revenue_view()
        self.query_one(QueuePanel).view = state.queue_view()
        self.query_one(TenantTable).views = state.tenant_views()
        touched = state.drain_touched()
        if touched:
            self.query_one(RequestsTable).show(state.traces, touched)

    def check_stale(self) -> None:
        state, header = self.state, self.query_one(StatusHeader)
        silent = None
        if state.connection.startswith("connected") and state.last_frame_at is not None:
            silent = self.now() - state.last_frame_at
        header.stale_s = silent if silent is not None and silent > STALE_AFTER_S else None

    # actions

    def action_toggle_pause(self) -> None:
        self.state.paused = not self.state.paused
        self.push_views()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_fleet(self) -> None:
        self.push_screen(FleetScreen(self.state.fleet_gpus), self.set_fleet)

    def set_fleet(self, gpus: int | None) -> None:
        if gpus:
            self.state.fleet_gpus = gpus
            self.query_one(RevenuePanel).view = self.state.revenue_view()

    @on(RequestsTable.Chosen)
    def open_waterfall(self, message: RequestsTable.Chosen) -> None:
        trace = self.state.traces.get(message.trace_id)
        if trace is not None:
            self.push_screen(WaterfallScreen(trace))
