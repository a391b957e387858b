"""Large tool and schema bodies on a real gateway (fake engine, loopback): each case failed
before.

Before: every tool's schema was meta-validated before the 64 KiB total of the tools'
parameters applied, on the event loop, and before the tenant's requests per minute were
charged; one body of many large tools held the loop for seconds (/health unanswered) and a
refused body cost its sender nothing. After every case the conftest's check also asserts the
loop was never held over 100 ms and the memory came back.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp

from tests.reliability.conftest import auth
from tests.reliability.test_hostile_input import assert_openai_error

CHAT, COMP, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"
HEALTH_WITHIN_S = 0.5
U = [{"role": "user", "content": "hi"}]


def schema(props: int) -> dict:
    """A valid object schema of about 88 bytes a property, unique to this call (the gateway
    keeps the verdicts of schemas it has seen: a repeated one would cost nothing)."""
    tag = uuid.uuid4().hex[:8]
    return {"type": "object", "required": [f"p{tag}0"], "properties": {
        f"p{tag}{i}": {"type": "string", "description": "d" * 20, "enum": ["a", "b", f"c{i}"]}
        for i in range(props)}}


def tools(count: int, props: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": schema(props)}}
            for i in range(count)]


def many_tools_body() -> dict:
    """128 tools of about 7.8 KB of parameters each: 1 MB in all, under the 1 MiB body limit
    but 15 times the tools' 64 KiB total."""
    return {"messages": U, "max_tokens": 2, "tools": tools(128, 84)}


async def _post(session, path: str, body: dict, key: str = "sk-alpha"):
    data = json.dumps(body, separators=(",", ":")).encode()  # compact: under the body limit
    async with session.post(path, data=data, headers={**auth(key), "Content-Type":
                                                     "application/json"},
                            timeout=aiohttp.ClientTimeout(total=60)) as r:
        return r.status, await r.read()


async def _health_while(session, work) -> tuple[list, float]:
    """Run `work` while asking /health every 50 ms: (work's results, the slowest answer)."""
    task = asyncio.ensure_future(work)
    slowest = 0.0
    while not task.done():
        start = time.monotonic()
        async with session.get("/health", timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200
        slowest = max(slowest, time.monotonic() - start)
        await asyncio.sleep(0.05)
    return await task, slowest


def run_with_health(gw, make_work):
    async def main():
        async with aiohttp.ClientSession(gw.url) as s:
            return await _health_while(s, make_work(s))
    return asyncio.run(main())


def assert_refused(status: int, raw: bytes, param: str, words: str) -> None:
    assert status == 400, raw[:300]
    error = assert_openai_error(400, raw)
    assert error["param"] == param and words in error["message"], error


def test_chat_with_many_large_tools_does_not_hold_the_loop(gw):
    (status, raw), slowest = run_with_health(gw, lambda s: _post(s, CHAT, many_tools_body()))
    assert_refused(status, raw, "tools", "at most 65536")
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.2f} s"


def test_tokenize_with_many_large_tools_does_not_hold_the_loop(gw):
    body = {"messages": U, "tools": tools(128, 84)}
    (status, raw), slowest = run_with_health(gw, lambda s: _post(s, TOKENIZE, body))
    assert_refused(status, raw, "tools", "at most 65536")
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.2f} s"


def test_six_parallel_large_response_formats_do_not_hold_the_loop(gw):
    """Six valid schemas of about 60 KB each (just under the 64 KiB cap), all new: each is
    checked in full, off the loop."""
    bodies = [{"messages": U, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": schema(690)}}}
        for _ in range(6)]

    def work(s):
        return asyncio.gather(*(_post(s, CHAT, b) for b in bodies))
    results, slowest = run_with_health(gw, work)
    assert [status for status, _ in results] == [200] * 6, results[0][1][:300]
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.2f} s"


def test_refused_bodies_count_against_requests_per_minute(gw):
    """The tenant "metered" may send 3 requests a minute: three bodies refused by validation
    (chat, /tokenize, completions) use them up, then even a valid request gets 429, and so
    does another bad body (the charge comes before the body is read)."""
    refused = [(CHAT, many_tools_body()), (TOKENIZE, {"prompt": "x", "messages": U}),
               (COMP, {"prompt": "x", "max_tokens": 0})]

    async def main():
        async with aiohttp.ClientSession(gw.url) as s:
            out = [await _post(s, path, body, "sk-metered") for path, body in refused]
            out.append(await _post(s, CHAT, {"messages": U, "max_tokens": 2}, "sk-metered"))
            out.append(await _post(s, CHAT, many_tools_body(), "sk-metered"))
            return out
    results = asyncio.run(main())
    assert [status for status, _ in results] == [400, 400, 400, 429, 429], results
    assert_openai_error(429, results[-1][1])


def test_over_cap_bodies_are_refused_before_any_schema_work(gw):
    """Bodies over a total cap are refused in time linear in their size, without one schema
    checked: the gateway's CPU time for all three stays far below what checking the schemas
    costs (about 3 s for the tools alone)."""
    big = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema(690)}}
    cases = [(many_tools_body(), "tools", "at most 65536"),
             ({"messages": U, "response_format": big, "guided_json": schema(690),
               "structured_outputs": {"json": schema(690)}}, "structured_outputs",
              "cannot be combined with response_format"),
             ({"messages": U, "tools": tools(8, 88), "response_format": big},
              "response_format", "cannot be combined with tools")]
    cpu = gw.cpu_seconds()
    for body, param, words in cases:
        status, raw = asyncio.run(_with_session(gw, body))
        assert_refused(status, raw, param, words)
    spent = gw.cpu_seconds() - cpu
    assert spent < 0.5, f"the gateway spent {spent:.2f} s of CPU refusing them"


async def _with_session(gw, body: dict):
    async with aiohttp.ClientSession(gw.url) as s:
        return await _post(s, CHAT, body)


def test_a_websocket_message_of_many_large_tools_does_not_hold_the_loop(gw):
    """The same body as one WebSocket request message: its decode and its validation run off
    the loop too, and it gets its error message."""
    async def work(session):
        async with session.ws_connect("/v1/ws", headers=auth("sk-alpha")) as ws:
            await ws.send_str(json.dumps({"type": "request", "id": "big", "endpoint": "chat",
                                          "body": many_tools_body()}, separators=(",", ":")))
            while True:
                message = json.loads((await ws.receive(timeout=60)).data)
                if message.get("id") == "big" and message["type"] in ("error", "done"):
                    return message
    message, slowest = run_with_health(gw, work)
    assert message["type"] == "error" and message["error"]["param"] == "tools", message
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.2f} s"
