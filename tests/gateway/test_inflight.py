"""The in-flight table: the one transition function, its allowed moves and its counts."""
from __future__ import annotations

import asyncio

import pytest

from contract.sampling_params import SamplingParams
from gateway.openai.requests import GenerationRequest
from gateway.serving.inflight import IllegalTransition, InFlightRequest, InFlightTable, Phase


def _record(request_id: str = "r", n: int = 2) -> InFlightRequest:
    request = GenerationRequest("completion", None, None, (1,), 4, {}, n=n)
    return InFlightRequest(request_id, request, [1], "x", SamplingParams(max_tokens=4), 0, None)


def test_a_request_walks_its_phases_and_is_found_by_its_engine_ids():
    async def main():
        table, rec = InFlightTable(), _record()
        assert table.get("r/0") is None
        for phase in (Phase.QUEUED, Phase.DISPATCHED, Phase.STREAMING):
            table.move(rec, phase)
            assert table.count(phase) == 1 and table.open == 1
            assert table.get("r/0") is rec and table.get("r/1") is rec
        table.move(rec, Phase.SETTLING)
        assert table.get("r/0") is None and table.open == 0  # no output is routed any more
        table.move(rec, Phase.DONE)
        assert sum(table.phases.values()) == 0 and rec.phase is Phase.DONE
    asyncio.run(main())


@pytest.mark.parametrize("path", [
    (Phase.DISPATCHED,),  # never queued
    (Phase.QUEUED, Phase.STREAMING),  # a token before any worker had it
    (Phase.QUEUED, Phase.QUEUED),
    (Phase.QUEUED, Phase.SETTLING, Phase.SETTLING),  # settled twice
    (Phase.SETTLING, Phase.DONE, Phase.QUEUED),  # back from the dead
])
def test_illegal_moves_are_refused(path):
    async def main():
        table, rec = InFlightTable(), _record()
        with pytest.raises(IllegalTransition):
            for phase in path:
                table.move(rec, phase)
    asyncio.run(main())


def test_a_refused_request_settles_from_any_phase_before_streaming():
    async def main():
        for before in ((), (Phase.QUEUED,), (Phase.QUEUED, Phase.DISPATCHED)):
            table, rec = InFlightTable(), _record(n=1)
            for phase in before:
                table.move(rec, phase)
            table.move(rec, Phase.SETTLING)
            assert table.get("r") is None and table.open == 0
    asyncio.run(main())
