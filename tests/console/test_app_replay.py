"""The console driven headless (Pilot) on the recorded feed: panels, keys, screens."""
from __future__ import annotations

import asyncio

from textual.widgets import Input

from console.app import ConsoleApp
from console.feed import Frame, ReplayFeed, Status, read_recording
from console.screens.fleet import FleetScreen
from console.screens.help import HelpScreen
from console.screens.waterfall import WaterfallScreen
from console.widgets.requests_table import RequestsTable
from console.widgets.revenue_panel import RevenuePanel
from console.widgets.span_waterfall import SpanWaterfall
from console.widgets.status_header import StatusHeader
from console.widgets.worker_table import WorkerTable
from tests.console.conftest import FEED, fixed_clock, replay_app, replay_finished, wait_until


def run(coro):
    return asyncio.run(coro)


def test_replay_fills_every_panel():
    async def main():
        app = replay_app()
        async with app.run_test(size=(200, 50)) as pilot:
            await replay_finished(pilot)
            state = app.state
            assert state.num_malformed == 0 and state.num_snapshots > 5
            assert app.query_one(WorkerTable).views[0].tokens_per_s > 0
            table = app.query_one(RequestsTable)
            assert table.row_count == len(state.traces) > 20
            assert table.cursor_row == table.row_count - 1  # follows the newest
            rev = app.query_one(RevenuePanel).view
            assert rev.fleet_gpus == 128
            assert rev.annual == rev.per_gpu_hour * 128 * 8760 > 0
            assert rev.margin == (rev.per_gpu_hour - 2.0) / 2.0
            assert len(state.tenant_views()) == 3
    run(main())


class GatedReplay:
    """The recording's first `split` frames, then a wait for `gate`, then the rest."""

    def __init__(self, split: int):
        self.split = split
        self.gate = asyncio.Event()

    async def events(self):
        frames = [f for _, f in read_recording(FEED)]
        for i, frame in enumerate(frames):
            if i == self.split:
                await self.gate.wait()
            yield Frame(frame)
        yield Status("ended")


def test_pause_freezes_the_display_but_not_the_feed():
    async def main():
        source = GatedReplay(split=12)
        app = ConsoleApp(source, now=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: app.state.num_frames == 12)
            table = app.query_one(RequestsTable)
            shown = table.row_count
            await pilot.press("p")
            assert "PAUSED" in str(app.query_one(StatusHeader).render())
            source.gate.set()
            await replay_finished(pilot)
            assert table.row_count == shown < len(app.state.traces)  # frozen, feed read on
            await pilot.press("p")
            assert table.row_count == len(app.state.traces)
            assert "PAUSED" not in str(app.query_one(StatusHeader).render())
    run(main())


def test_fleet_size_key_changes_the_projection():
    async def main():
        app = replay_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await replay_finished(pilot)
            await pilot.press("f")
            assert isinstance(app.screen, FleetScreen)
            field = app.screen.query_one(Input)
            field.value = "0"
            await pilot.press("enter")
            assert isinstance(app.screen, FleetScreen)  # refused: not a fleet
            field.value = ""
            await pilot.press(*"1024", "enter")
            await pilot.pause()
            assert not isinstance(app.screen, FleetScreen)
            rev = app.query_one(RevenuePanel).view
            assert rev.fleet_gpus == 1024 and rev.annual == rev.per_gpu_hour * 1024 * 8760
    run(main())


def test_choosing_a_request_opens_its_waterfall_and_escape_returns():
    async def main():
        app = replay_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await replay_finished(pilot)
            table = app.query_one(RequestsTable)
            table.focus()
            await pilot.press("up", "enter")
            await pilot.pause()
            assert isinstance(app.screen, WaterfallScreen)
            trace = app.screen.query_one(SpanWaterfall).trace
            assert trace.trace_id == list(app.state.traces.traces)[-2]
            assert [s.name for s in trace.ordered()] == ["llm.request", "queue", "prefill",
                                                         "decode"]
            await pilot.press("escape")
            assert not isinstance(app.screen, WaterfallScreen)
    run(main())


def test_help_opens_and_closes_and_q_quits():
    async def main():
        app = replay_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("q")
            await pilot.pause()
        assert app.return_code == 0
    run(main())


def test_a_corrupt_recording_is_survived(tmp_path):
    lines = FEED.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{not json", '{"t": 0.1, "frame": [1, 2]}',
                              '{"t": 0.2, "frame": {"type": "snapshot", "workers": "x"}}',
                              '{"t": 0.3, "frame": {"type": "mystery"}}', *lines[1:12]]) + "\n")

    async def main():
        app = replay_app(bad)
        async with app.run_test(size=(120, 40)) as pilot:
            await replay_finished(pilot)
            assert app.state.num_malformed == 3  # a snapshot with a bad field still counts
            assert app.query_one(WorkerTable).views  # later good frames still shown
    run(main())


def test_old_requests_leave_the_table():
    async def main():
        app = ConsoleApp(ReplayFeed(FEED, speed=0), now=fixed_clock, max_requests=10)
        async with app.run_test(size=(120, 40)) as pilot:
            await replay_finished(pilot)
            table = app.query_one(RequestsTable)
            assert table.row_count == 10
            assert [k.value for k in table.rows] == list(app.state.traces.traces)
    run(main())
