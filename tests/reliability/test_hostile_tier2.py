"""The second tier of hostile input: type confusion, numeric edges and amplification.

Each case gets its status (200 where the value is legal at its edge) with an OpenAI error body
naming the param, for bounded gateway CPU; afterwards the queue still drains. The after-every-
case invariant check of conftest.py (no leaked block, slot, charge, reservation or queue entry,
the dispatch loop ticking) runs after each of them.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from contract.sampling_params import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
)
from gateway.openai.requests import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_N
from tests.reliability.conftest import auth
from tests.reliability.test_hostile_input import CPU_LIMIT_S, _post, assert_openai_error

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
U = {"role": "user", "content": "hello"}


def chat(**kw) -> bytes:
    return json.dumps({"messages": [U], "max_tokens": 2, **kw}).encode()


def comp(**kw) -> bytes:
    return json.dumps({"prompt": "hello", "max_tokens": 2, **kw}).encode()


def raw(fields: bytes) -> bytes:
    return b'{"prompt": "hello", "max_tokens": 2, ' + fields + b"}"


def parts(n: int) -> bytes:
    return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * n}])


# (case id, path, body, expected status, expected param, expected code or None)
TYPE_CONFUSION = [
    ("n-bool", COMP, comp(n=True), 400, "n", None),
    ("temperature-bool", COMP, comp(temperature=False), 400, "temperature", None),
    ("top-p-bool", COMP, comp(top_p=True), 400, "top_p", None),
    ("top-k-float", COMP, comp(top_k=2.5), 400, "top_k", None),
    ("top-k-bool", COMP, comp(top_k=True), 400, "top_k", None),
    ("seed-float", COMP, comp(seed=1.0), 400, "seed", None),
    ("seed-string", COMP, comp(seed="1"), 400, "seed", None),
    ("seed-bool", COMP, comp(seed=True), 400, "seed", None),
    ("chat-logprobs-int", CHAT, chat(logprobs=1), 400, "logprobs", None),
    ("completion-logprobs-bool", COMP, comp(logprobs=True), 400, "logprobs", None),
    ("echo-int", COMP, comp(echo=1), 400, "echo", None),
    ("priority-float", COMP, comp(priority=0.5), 400, "priority", None),
    ("stop-token-ids-bools", COMP, comp(stop_token_ids=[True]), 400, "stop_token_ids", None),
    ("stop-token-ids-floats", COMP, comp(stop_token_ids=[1.0]), 400, "stop_token_ids", None),
    ("stop-token-ids-negative", COMP, comp(stop_token_ids=[-1]), 400, "stop_token_ids", None),
    ("stop-token-ids-object", COMP, comp(stop_token_ids={"a": 1}), 400, "stop_token_ids",
     None),
    ("prompt-ids-bools", COMP, comp(prompt=[True, False]), 400, "prompt", None),
    ("prompt-ids-floats", COMP, comp(prompt=[1.5]), 400, "prompt", None),
    ("max-tokens-nan", COMP, raw(b'"temperature": 1, "max_tokens": NaN'), 400, None, None),
    ("top-p-infinity", COMP, raw(b'"top_p": Infinity'), 400, None, None),
    ("penalty-negative-infinity", COMP, raw(b'"presence_penalty": -Infinity'), 400, None,
     None),
    ("ignore-eos-string", COMP, comp(ignore_eos="true"), 400, "ignore_eos", None),
    ("stream-options-array", COMP, comp(stream=True, stream_options=[1]), 400,
     "stream_options", None),
    ("include-usage-string", COMP, comp(stream=True, stream_options={"include_usage": "y"}),
     400, "stream_options.include_usage", None),
    ("text-part-number", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]), 400, "messages[0].content[0].text", None),
    ("user-number", COMP, comp(user=5), 400, "user", None),
    ("model-number", COMP, comp(model=5), 400, "model", None),
    ("stop-object", COMP, comp(stop={"a": "b"}), 400, "stop", None),
    ("message-array", CHAT, chat(messages=[["user", "hi"]]), 400, "messages[0]", None),
]

NUMERIC_EDGES = [
    ("seed-max-n8", COMP, comp(seed=MAX_SEED, n=MAX_N), 200, None, None),
    ("seed-min-n8", CHAT, chat(seed=MIN_SEED, n=MAX_N), 200, None, None),
    ("seed-minus-one-n2", COMP, comp(seed=-1, n=2), 200, None, None),
    ("seed-above-max", COMP, comp(seed=MAX_SEED + 1), 400, "seed", None),
    ("seed-below-min", COMP, comp(seed=MIN_SEED - 1), 400, "seed", None),
    ("n-fraction", COMP, comp(n=1.5), 400, "n", None),
    ("n-above-max", COMP, comp(n=MAX_N + 1), 400, "n", None),
    ("max-tokens-zero-float", COMP, comp(max_tokens=0.0), 400, "max_tokens", None),
    ("max-tokens-fraction", CHAT, chat(max_tokens=2.5), 400, "max_tokens", None),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("top-logprobs-fraction", CHAT, chat(logprobs=True, top_logprobs=2.5), 400,
     "top_logprobs", None),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs", None),
    ("temperature-zero", COMP, comp(temperature=0), 200, None, None),
    ("temperature-max", COMP, comp(temperature=2.0), 200, None, None),
    ("temperature-above-max", COMP, comp(temperature=2.0000001), 400, "temperature", None),
    ("priority-most-urgent", COMP, comp(priority=-1000), 200, None, None),
    ("priority-past-least", COMP, comp(priority=1001), 400, "priority", None),
    ("top-k-minus-one", COMP, comp(top_k=-1), 200, None, None),
    ("top-k-minus-two", COMP, comp(top_k=-2), 400, "top_k", None),
    ("min-p-one", COMP, comp(min_p=1.0), 200, None, None),
    ("repetition-penalty-zero", COMP, comp(repetition_penalty=0), 400, "repetition_penalty",
     None),
    ("ttft-deadline-zero", COMP, comp(ttft_deadline_ms=0), 400, "ttft_deadline_ms", None),
    ("ttft-deadline-bool", COMP, comp(ttft_deadline_ms=True), 400, "ttft_deadline_ms", None),
]

AMPLIFICATION = [
    ("stop-at-cap", COMP, comp(stop=[f"#{i}" for i in range(MAX_STOP_STRINGS)]), 200, None,
     None),
    ("stop-past-cap", COMP, comp(stop=[f"#{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400,
     "stop", "array_too_long"),
    ("stop-token-ids-at-cap", COMP, comp(stop_token_ids=list(range(1, MAX_STOP_TOKEN_IDS + 1))),
     200, None, None),
    ("stop-token-ids-past-cap", COMP,
     comp(stop_token_ids=list(range(1, MAX_STOP_TOKEN_IDS + 2))), 400, "stop_token_ids",
     "array_too_long"),
    ("stop-token-ids-150k", CHAT, chat(stop_token_ids=[1] * 150_000, n=MAX_N), 400,
     "stop_token_ids", "array_too_long"),
    ("messages-fit", CHAT, chat(messages=[{"role": "user", "content": "a"}] * 1000), 200,
     None, None),
    ("messages-at-cap", CHAT, chat(messages=[{"role": "user", "content": "a"}] * MAX_MESSAGES),
     400, "messages", "context_length_exceeded"),
    ("messages-past-cap", CHAT,
     chat(messages=[{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)), 400, "messages",
     "array_too_long"),
    ("messages-30k-empty", CHAT, chat(messages=[{"role": "user", "content": ""}] * 30_000),
     400, "messages", "array_too_long"),
    ("content-parts-at-cap", CHAT, parts(MAX_CONTENT_PARTS), 200, None, None),
    ("content-parts-past-cap", CHAT, parts(MAX_CONTENT_PARTS + 1), 400,
     "messages[0].content", "array_too_long"),
    ("top-logprobs-at-cap", CHAT, chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS), 200,
     None, None),
    ("top-logprobs-past-cap", CHAT, chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1),
     400, "top_logprobs", None),
    ("large-text-under-the-byte-check", CHAT, chat(messages=[{"role": "user", "content":
                                                             "word " * 150_000}]), 400,
     "messages", "context_length_exceeded"),
    ("n-times-every-cost", CHAT, chat(
        n=MAX_N, max_tokens=64, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS,
        stop=[f"#{i}" for i in range(MAX_STOP_STRINGS)],
        stop_token_ids=list(range(1, MAX_STOP_TOKEN_IDS + 1)), seed=MAX_SEED), 200, None, None),
]

CASES = TYPE_CONFUSION + NUMERIC_EDGES + AMPLIFICATION


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_tier2_body(gw, name, path, body, status, param, code):
    cpu = gw.cpu_seconds()
    got, _, raw_body = asyncio.run(_post(gw.url, path, body))
    assert got == status, raw_body[:300]
    if status == 200:
        answer = json.loads(raw_body)
        n = json.loads(body).get("n", 1)
        assert len(answer["choices"]) == n and answer["usage"]["completion_tokens"] >= n
    else:
        err = assert_openai_error(got, raw_body, param)
        if code is not None:
            assert err["code"] == code, err
    assert gw.cpu_seconds() - cpu < CPU_LIMIT_S


def test_every_cost_at_once_streams_to_the_end(gw):
    """n at its cap times every list at its cap, streamed: each choice finishes and the
    usage chunk arrives before [DONE]."""
    body = json.loads(AMPLIFICATION[-1][2])

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + CHAT, json={**body, "stream": True,
                                                   "stream_options": {"include_usage": True}},
                              headers=auth("sk-alpha")) as r:
                assert r.status == 200
                return await r.read()
    events = [line[6:] for line in asyncio.run(main()).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")}
    assert finished == set(range(MAX_N))
    assert chunks[-1]["usage"]["completion_tokens"] >= MAX_N


def test_the_queue_still_drains_after_the_hostile_tiers(gw):
    """Sixteen ordinary requests at once, twice the worker's slots: all complete."""
    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(i: int):
                async with s.post(gw.url + COMP, json={"prompt": f"after {i}", "max_tokens": 8},
                                  headers=auth("sk-beta")) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(i) for i in range(16)))
    results = asyncio.run(main())
    assert all(status == 200 and body["usage"]["completion_tokens"] == 8
               for status, body in results), results
