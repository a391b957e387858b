"""The asyncio wrapper streams outputs without blocking the loop and aborts on early exit."""
import asyncio

import pytest

from runtime.async_engine import AsyncEngine
from runtime.errors import InvalidRequestError
from runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def collect(aengine, rid, prompt, params=PARAMS):
    return [o async for o in aengine.generate(rid, prompt, params)]


def test_concurrent_streams_match_the_sync_engine(make_tiny_engine):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    expected = make_tiny_engine().generate(prompts, PARAMS)

    async def main():
        aengine = AsyncEngine(make_tiny_engine())
        aengine.start()
        try:
            ticks = 0

            async def ticker():  # the loop must stay responsive while the engine steps
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)
            t = asyncio.create_task(ticker())
            results = await asyncio.gather(*(collect(aengine, f"r{i}", p)
                                             for i, p in enumerate(prompts)))
            t.cancel()
            return results, ticks
        finally:
            await aengine.stop()

    results, ticks = asyncio.run(main())
    assert ticks > 0
    for outs, exp in zip(results, expected):
        assert [t for o in outs for t in o.new_token_ids] == exp
        assert outs[-1].finished and outs[-1].usage.completion_tokens == 8


def test_leaving_a_stream_early_aborts_and_frees_blocks(make_tiny_engine):
    engine = make_tiny_engine()

    async def main():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            async for out in aengine.generate("x", [5, 6, 7], params):
                break
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
        finally:
            await aengine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_invalid_request_raises_before_anything_is_queued(make_tiny_engine):
    async def main():
        aengine = AsyncEngine(make_tiny_engine())
        aengine.start()
        try:
            with pytest.raises(InvalidRequestError):
                await collect(aengine, "bad", [])
            assert aengine.num_open_streams == 0
        finally:
            await aengine.stop()
    asyncio.run(main())
