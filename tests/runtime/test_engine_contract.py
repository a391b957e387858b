"""One contract for every engine the gateway can reach: the model engine and the fake engine
in process, and both again behind a worker process driven over frames by the gateway's own
WorkerHandle. The same scenarios, the same assertions (runtime/engine_core.py's invariants)."""
from __future__ import annotations

import asyncio

import pytest

from contract.errors import RuntimeErrorBase
from contract.frames import AddRequest, Rejected
from contract.sampling_params import SamplingParams
from gateway.workers.handle import WorkerHandle
from gateway.workers.output_stream import OutputStream
from runtime.engine_core import EngineCore
from runtime.transport.worker import output_message

PROMPT = [5, 6, 7, 8, 9]


def _rejected(request_id: str) -> dict:
    return {"id": request_id, "tokens": [], "finished": True, "reason": "rejected",
            "usage": None}


class InProcess:
    """Drives an EngineCore the way runtime/transport/worker.py does: add, abort, step."""

    def __init__(self, engine):
        assert isinstance(engine, EngineCore)
        self.engine = engine
        self.pending: list[dict] = []

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams):
        try:
            self.engine.add_request(request_id, prompt, params)
        except RuntimeErrorBase:
            self.pending.append(_rejected(request_id))

    async def abort(self, request_id: str) -> None:
        final = self.engine.abort_request(request_id)
        if final is not None:
            self.pending.append(output_message(final))

    async def outputs(self) -> list[dict]:
        out, self.pending = self.pending, []
        # step until something comes out, as the worker does: an overlapped step's outputs
        # leave with the next one (runtime/execution/overlap.py)
        while not out and self.engine.has_unfinished_requests():
            out = [output_message(o) for o in self.engine.step()[0]]
        return out

    async def close(self) -> None:
        self.engine.close()


class OverFrames:
    """Drives a worker process through the gateway's WorkerHandle: frames both ways."""

    def __init__(self, argv: list[str]):
        self.handle = WorkerHandle(0, argv, ready_timeout=120)
        self.stream = OutputStream()

    async def start(self) -> OverFrames:
        await self.handle.start()
        return self

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams):
        self.handle.submit([AddRequest(request_id, prompt, params)], self.stream, 0, len(prompt))

    async def abort(self, request_id: str) -> None:
        self.handle.abort(request_id)

    async def outputs(self) -> list[dict]:
        items = [await asyncio.wait_for(self.stream.get(), 60)]
        while self.stream.qsize():
            items.append(await self.stream.get())
        return [_rejected(i.id) if isinstance(i, Rejected) else i for i in items]

    async def close(self) -> None:
        await self.handle.close()


async def _run_until_finished(driver, request_ids) -> dict[str, list[dict]]:
    seen: dict[str, list[dict]] = {rid: [] for rid in request_ids}
    while not all(seen[r] and seen[r][-1]["finished"] for r in request_ids):
        for out in await driver.outputs():
            assert not (seen[out["id"]] and seen[out["id"]][-1]["finished"]), \
                f"output after the final one: {out}"
            seen[out["id"]].append(out)
    return seen


def _tokens(outs: list[dict]) -> list[int]:
    return [t for o in outs for t in o["tokens"]]


# ---- the scenarios ------------------------------------------------------------------------
async def lengths_and_usage(driver) -> None:
    budgets = {"a": 3, "b": 5, "c": 7}
    for rid, n in budgets.items():
        await driver.submit(rid, PROMPT, SamplingParams(max_tokens=n, temperature=0))
    seen = await _run_until_finished(driver, budgets)
    for rid, n in budgets.items():
        final = seen[rid][-1]
        assert final["reason"] == "length" and len(_tokens(seen[rid])) == n
        assert final["usage"][0] == len(PROMPT) and final["usage"][2] == n
        assert sum(o["finished"] for o in seen[rid]) == 1


async def abort_ends_once(driver) -> None:
    await driver.submit("long", PROMPT, SamplingParams(max_tokens=200, temperature=0))
    first = [o for o in await driver.outputs() if o["id"] == "long"]
    assert first and not first[-1]["finished"]
    await driver.abort("long")
    seen = await _run_until_finished(driver, ["long"])
    final = seen["long"][-1]
    assert final["reason"] == "abort" and final["usage"][2] < 200
    assert final["usage"][2] == len(_tokens(first + seen["long"]))


async def refusals_change_nothing(driver) -> None:
    """Requests the engine must refuse (unique ids: the gateway never reuses one) end as
    rejected with nothing produced; the request running beside them is untouched."""
    await driver.submit("ok", PROMPT, SamplingParams(max_tokens=4, temperature=0))
    await driver.submit("vocab", [10 ** 9], SamplingParams(max_tokens=4))
    await driver.submit("empty", [], SamplingParams(max_tokens=4))
    await driver.submit("huge", PROMPT, SamplingParams(max_tokens=10 ** 7))
    seen = await _run_until_finished(driver, ["ok", "vocab", "empty", "huge"])
    for rid in ("vocab", "empty", "huge"):
        assert [o["reason"] for o in seen[rid]] == ["rejected"], seen[rid]
    assert seen["ok"][-1]["reason"] == "length" and len(_tokens(seen["ok"])) == 4


async def stop_token_ids_stop(driver) -> None:
    await driver.submit("probe", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    first = _tokens((await _run_until_finished(driver, ["probe"]))["probe"])[0]
    await driver.submit("stopped", PROMPT, SamplingParams(max_tokens=20, temperature=0,
                                                          stop_token_ids=(first,)))
    final = (await _run_until_finished(driver, ["stopped"]))["stopped"][-1]
    assert final["reason"] == "stop" and final["stop_reason"] == first
    assert final["usage"][2] == 1


async def prompt_logprobs_once(driver) -> None:
    """Asked for, prompt logprobs come once, on the first output with tokens: None for the
    first prompt token, then [the token, a logprob, its rank, k alternatives best first]. The
    request reads no prefix cache (0 cached), though the cache was warm for the same prompt."""
    prompt, k = list(range(5, 45)), 3  # two full blocks of 16 before the last token
    plain = SamplingParams(max_tokens=2, temperature=0)
    cached = {}
    for rid in ("warm", "warmed"):
        await driver.submit(rid, prompt, plain)
        cached[rid] = (await _run_until_finished(driver, [rid]))[rid][-1]["usage"][1]
    assert cached["warmed"] > 0  # the cache holds the prompt now
    await driver.submit("asks", prompt, SamplingParams(max_tokens=3, temperature=0,
                                                       prompt_logprobs=k))
    outs = (await _run_until_finished(driver, ["asks"]))["asks"]
    carrying = [o for o in outs if o.get("prompt_logprobs") is not None]
    assert carrying == [next(o for o in outs if o["tokens"])]
    assert outs[-1]["usage"][1] == 0
    entries = carrying[0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for token, (scored, logprob, rank, top) in zip(prompt[1:], entries[1:]):
        assert scored == token and -9999.0 <= logprob <= 0 and rank >= 1
        values = [lp for _, lp in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        assert logprob <= values[0] and (rank > 1 or logprob == values[0])


SCENARIOS = [lengths_and_usage, abort_ends_once, refusals_change_nothing, stop_token_ids_stop,
             prompt_logprobs_once]


# ---- the engines --------------------------------------------------------------------------
@pytest.fixture(params=["model", "fake", "model-worker", "fake-worker"])
def make_driver(request, make_tiny_engine, tiny_model_dir):
    kind = request.param

    async def make():
        if kind == "model":
            return InProcess(make_tiny_engine())
        if kind == "fake":
            from runtime.fake_engine import FakeEngine
            return InProcess(FakeEngine(step_seconds=0))
        argv = ["--fake", "--fake-step-ms", "0"] if kind == "fake-worker" else [
            "--model", str(tiny_model_dir), "--kv-cache-gb", "0.01", "--threads", "1"]
        return await OverFrames(argv).start()
    return make


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_every_engine_keeps_the_contract(make_driver, scenario):
    async def main():
        driver = await make_driver()
        try:
            await scenario(driver)
        finally:
            await driver.close()
    asyncio.run(main())
