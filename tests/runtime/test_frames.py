"""The frames that carry sampling parameters (contract/frames.py): each round-trips through the
one encoder and decoder with its `SamplingParams` whole (tuples restored, validated), a bad
params payload is a malformed frame, and both workers treat it as one (the pipe worker exits 1;
a shared worker closes only that connection). The Ready frame reports the KV capacity."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import orjson
import pytest

from contract.frames import (
    AddRequest,
    ImportKV,
    ProtocolError,
    Ready,
    decode_frame,
    encode_frame,
    read_frame_blocking,
)
from contract.sampling_params import SamplingParams
from runtime.fake_engine import FakeEngine
from runtime.transport.worker import Worker
from tests.runtime.test_serve import FAKE, LONG, FrameClient, ServeProcess

# every field off its default, so that a field the encoder dropped would show
FULL = SamplingParams(
    max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3,
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, stop=("\n", "END"),
    stop_token_ids=(2, 7), ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2,
    speculative=False, structured={"type": "choice", "choices": ["a", "b"], "param": "x"},
    jump_forward=False, reasoning_budget=128)
WITH_PARAMS = {
    "add": AddRequest("r", [1, 2, 3], FULL, priority=-2, salt="s", prefill_only=True),
    "import": ImportKV("r", [1, 2, 3], [4], FULL, key="1-2", tag=7, priority=1, salt="s",
                       cached=16, timing={"arrival": 1.5}),
}
BAD_PARAMS = {
    "not an object": [64],
    "an unknown field": {"max_tokens": 4, "best_of": 2},
    "a bad value": {"max_tokens": 4, "temperature": -1.0},
    "a wrong type": {"max_tokens": 4, "top_p": "high"},
    "a bad stop list": {"max_tokens": 4, "stop": 5},
    "a bad grammar spec": {"max_tokens": 4, "structured": {"type": "nope"}},
}


def round_trip(frame):
    return decode_frame(encode_frame(frame)[4:])


def test_full_sets_every_field_off_its_default():
    assert all(getattr(FULL, f.name) != f.default for f in fields(SamplingParams))


@pytest.mark.parametrize("kind", WITH_PARAMS)
def test_a_frame_with_params_round_trips_whole(kind):
    frame = WITH_PARAMS[kind]
    back = round_trip(frame)
    assert back == frame and isinstance(back.params, SamplingParams)
    assert type(back.params.stop) is tuple and type(back.params.stop_token_ids) is tuple
    assert back.params.stop_token_set == {2, 7}
    assert back.params.structured_key == FULL.structured_key


def test_params_travel_as_their_fields_and_nothing_derived():
    body = orjson.loads(encode_frame(WITH_PARAMS["add"])[4:])
    assert set(body["params"]) == {f.name for f in fields(SamplingParams)}
    assert body["params"]["stop"] == ["\n", "END"]


def test_omitted_params_fields_take_their_defaults_as_in_a_call():
    message = {"type": "add", "id": "r", "prompt": [1], "params": {"max_tokens": 3}}
    assert decode_frame(orjson.dumps(message)).params == SamplingParams(max_tokens=3)


@pytest.mark.parametrize("kind", WITH_PARAMS)
@pytest.mark.parametrize("why", BAD_PARAMS)
def test_a_bad_params_payload_is_a_malformed_frame(kind, why):
    message = orjson.loads(encode_frame(WITH_PARAMS[kind])[4:])
    message["params"] = BAD_PARAMS[why]
    with pytest.raises(ProtocolError, match=f"{kind} frame: params"):
        decode_frame(orjson.dumps(message))


def test_ready_reports_the_kv_capacity_and_round_trips():
    ready = Worker(FakeEngine(step_seconds=0, num_blocks=8)).ready_message()
    assert ready.kv_capacity_tokens == 8 * 16
    assert round_trip(ready) == ready


def _bad_add() -> bytes:
    message = orjson.loads(encode_frame(AddRequest("bad", [1, 2], FULL))[4:])
    message["params"]["temperature"] = -1.0
    body = orjson.dumps(message)
    return len(body).to_bytes(4, "big") + body


def test_the_pipe_worker_exits_on_a_bad_params_frame():
    proc = subprocess.Popen([sys.executable, "-m", "runtime.transport.worker", "--fake"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert isinstance(read_frame_blocking(proc.stdout), Ready)
        proc.stdin.write(_bad_add())
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 1  # as for any frame it cannot read
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_shared_worker_closes_only_the_connection_with_bad_params():
    serve = ServeProcess(*FAKE)
    good = bad = None
    try:
        good = FrameClient(serve.port)
        good.add("g", [7, 8, 9], LONG)
        good.outputs_of("g", 1)
        bad = FrameClient(serve.port)
        bad.sock.sendall(_bad_add())
        assert bad.closed_by_worker()
        assert serve.proc.poll() is None
        assert not any(o["finished"] for o in good.outputs_of("g", 2))
    finally:
        for client in (good, bad):
            if client is not None:
                client.close()
        serve.stop()
