"""SVG snapshots of the console on the recorded feed, clock fixed, at fixed terminal sizes.

Regenerate after an intended change: pytest tests/console/test_snapshots.py --snapshot-update
"""
from __future__ import annotations

import pytest

from console.widgets.requests_table import RequestsTable
from tests.console.conftest import replay_app, replay_finished


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_dashboard(snap_compare, size):
    assert snap_compare(replay_app(), terminal_size=size, run_before=replay_finished)


def test_span_waterfall(snap_compare):
    async def open_first_request(pilot):
        await replay_finished(pilot)
        pilot.app.query_one(RequestsTable).focus()
        await pilot.press("home", "enter")

    assert snap_compare(replay_app(), terminal_size=(120, 30), run_before=open_first_request)


def test_help_screen(snap_compare):
    async def open_help(pilot):
        await replay_finished(pilot)
        await pilot.press("question_mark")

    assert snap_compare(replay_app(), terminal_size=(100, 30), run_before=open_help)
