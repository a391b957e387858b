"""POST /v1/messages and /v1/messages/count_tokens on a fake-engine gateway: the official
anthropic SDK, unchanged (create, stream, count_tokens, a tool round trip), every raw event
validated by the SDK's own types, the SDK's stream accumulator rebuilding the non-streamed
message, usage equal to the ledger's row, errors in Anthropic's shape and statuses on every
path (shared code's included), and the event translation of tool use and thinking, split at
every boundary (the fake engine writes neither)."""
from __future__ import annotations

import asyncio
import json
import sqlite3
from types import SimpleNamespace

import aiohttp
import anthropic
import jsonschema
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from gateway.anthropic.errors import error_body, error_event, error_status
from gateway.anthropic.messages_api import (
    MessageEvents,
    content_blocks,
    matched_stop,
    message_shell,
    parse_count_tokens_request,
    parse_messages_request,
    tool_reader,
)
from gateway.errors import APIError
from gateway.http.error_middleware import error_middleware
from gateway.http.messages_route import MessageStream
from gateway.openai.reasoning import reasoning_split_for
from gateway.openai.requests import parse_chat_request
from gateway.state import STATE
from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file
from tests.reliability.test_fuzz_openapi import from_schema, mutated

FAKE_TEXT = " The quick brown fox jumps over the lazy dog and keeps running through the field."
MODEL = "fake-smollm2"
EVENT = TypeAdapter(RawMessageStreamEvent)
MESSAGE = TypeAdapter(Message)
ERROR = TypeAdapter(ErrorResponse)
KEYS = [("sk-alpha", "alpha", False, False), ("sk-admin", "ops", True, False),
        ("sk-slow", "slow", False, False)]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
         "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01",
         "content": [{"type": "text", "text": "sunny, 21 C", "cache_control":
                      {"type": "ephemeral"}}]},
        {"type": "text", "text": "And so?"}]}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    server = GatewayProcess("--fake", "--fake-step-ms", "2", "--prices", "seed",
                            "--keepalive-seconds", "0.05",
                            "--keys-file", write_key_file(tmp / "keys.toml",
                                                          {"alpha": {}, "ops": {},
                                                           "slow": {"requests_per_minute": 1}},
                                                          KEYS),
                            "--ledger-path", str(tmp / "ledger.sqlite3"))
    server.admin_key = "sk-admin"
    server.ledger = str(tmp / "ledger.sqlite3")
    yield server
    server.stop()


def client(gw, key="sk-alpha") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def post(gw, path, body=None, headers=None, raw: bytes | None = None, method="POST"):
    """(status, headers, JSON body) of one plain request, the key sent as x-api-key."""
    async def go():
        sent = {"x-api-key": "sk-alpha", "anthropic-version": "2023-06-01",
                "Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else json.dumps(body).encode()
        async with aiohttp.ClientSession() as s, s.request(method, gw.url + path, data=data,
                                                           headers=sent) as r:
            return r.status, r.headers.copy(), await r.json(content_type=None)
    return asyncio.run(go())


def raw_stream(gw, body):
    """The raw SSE answer: [(event line's name, data)], keep-alive comments refused."""
    async def go():
        async with aiohttp.ClientSession() as s, s.post(
                gw.url + "/v1/messages", json={**body, "stream": True},
                headers={"x-api-key": "sk-alpha"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.headers.copy(), await r.read()
    headers, raw = asyncio.run(go())
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and \
            lines[1].startswith("data: "), block
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return headers, events


def rebuilt(events: list[dict]):
    """The message the SDK's own stream accumulator makes of the events, each validated by
    the SDK's event types first."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for data in events:
        if data["type"] == "ping":
            assert data == {"type": "ping"}
            continue
        event = EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def ledger_row(gw, request_id):
    post(gw, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "x"}]})
    asyncio.run(_flush(gw))
    with sqlite3.connect(gw.ledger) as db:
        db.row_factory = sqlite3.Row
        return db.execute("SELECT * FROM requests WHERE id = ?", (request_id,)).fetchone()


async def _flush(gw):  # /admin/usage flushes the ledger before it reads
    async with aiohttp.ClientSession() as s, s.get(
            gw.url + "/admin/usage", headers={"Authorization": "Bearer sk-admin"}) as r:
        assert r.status == 200


# the SDK both ways

def test_create_is_a_valid_message_billed_as_the_ledger_says(gw):
    raw = client(gw).messages.with_raw_response.create(
        model=MODEL, max_tokens=5, system=[{"type": "text", "text": "Be brief.",
                                            "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hello"}], metadata={"user_id": "u-1"},
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})  # older SDKs' fields
    m = raw.parse()
    assert m.id.startswith("msg_") and raw.headers["x-request-id"] == m.id
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == FAKE_TEXT[:26]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.cache_creation_input_tokens == 0
    MESSAGE.validate_python(json.loads(raw.http_response.content))  # strictly typed
    # the same prompt again: a prefix-cache hit, reported as Anthropic reports cache reads
    again = client(gw).messages.create(
        model=MODEL, max_tokens=5, system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}])
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    row = ledger_row(gw, again.id)
    assert row["cache_hit_tokens"] == again.usage.cache_read_input_tokens
    assert row["cache_miss_tokens"] == again.usage.input_tokens
    assert row["output_tokens"] == again.usage.output_tokens == 5 and row["status"] == "ok"
    assert row["kind"] == "messages"
    assert row["cost_total"] == pytest.approx(again.usage.cost["total"])


def test_stream_events_in_order_and_rebuilt_by_the_sdk(gw):
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user",
                                                          "content": "Stream please"}]}
    headers, events = raw_stream(gw, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"] == headers["x-request-id"] and start["content"] == []
    assert start["stop_reason"] is None
    message = rebuilt([data for _, data in events])
    whole = client(gw).messages.create(**body)
    assert [b.model_dump() for b in message.content] == [b.model_dump() for b in whole.content]
    assert message.stop_reason == whole.stop_reason == "max_tokens"
    row = ledger_row(gw, message.id)
    assert (row["cache_hit_tokens"], row["cache_miss_tokens"], row["output_tokens"]) == (
        message.usage.cache_read_input_tokens, message.usage.input_tokens,
        message.usage.output_tokens)
    assert row["kind"] == "messages"


def test_sdk_stream_helper_and_stop_sequences(gw):
    with client(gw).messages.stream(model=MODEL, max_tokens=20, stop_sequences=["nope", "fox"],
                                    messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == " The quick brown " == final.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "fox"
    whole = client(gw).messages.create(model=MODEL, max_tokens=20, stop_sequences=["fox"],
                                       messages=[{"role": "user", "content": "Hi"}])
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == "fox"


def test_keepalive_and_mid_stream_errors_are_anthropic_events():
    """The gateway's keep-alive on this stream is Anthropic's ping event (never an SSE
    comment), and an error after the stream opened is its `error` event."""
    sent: list[bytes] = []

    class Sse:
        closed = False

        async def send_bytes(self, data: bytes) -> bool:
            sent.append(data)
            return True

    stream = MessageStream.__new__(MessageStream)
    stream.sse, stream.opening = Sse(), asyncio.Lock()
    assert asyncio.run(stream.keepalive())
    assert sent == [b'event: ping\ndata: {"type":"ping"}\n\n']
    event = error_event(APIError(503, "the worker serving this request failed"))
    assert event == {"type": "error", "error": {"type": "overloaded_error", "message":
                                                "the worker serving this request failed"}}
    ERROR.validate_python(event)


def test_count_tokens_is_what_the_message_is_billed_as_input(gw):
    kwargs = dict(model=MODEL, system="You answer with tools.", messages=ROUND_TRIP,
                  tools=[WEATHER])
    count = client(gw).messages.count_tokens(**kwargs)
    assert isinstance(count, MessageTokensCount)
    m = client(gw).messages.create(max_tokens=3, **kwargs)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    bare = client(gw).messages.count_tokens(model=MODEL, messages=ROUND_TRIP)
    assert bare.input_tokens < count.input_tokens  # the tools are rendered in the prompt
    # the conversation renders as the chat it stands for (vLLM's /tokenize counts that one)
    chat = {"messages": [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "sunny, 21 C"},
        {"role": "user", "content": "And so?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}]}
    status, _, tokenized = post(gw, "/tokenize", chat)
    assert status == 200 and tokenized["count"] == count.input_tokens


def test_tool_round_trip_with_every_tool_choice(gw):
    """The conversation of a call and its result, under each tool_choice (the fake engine
    writes its word cycle whatever the constraint: the answer is its text)."""
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "none"},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        m = client(gw).messages.create(model=MODEL, max_tokens=4, messages=ROUND_TRIP,
                                       tools=[WEATHER], tool_choice=choice)
        assert m.stop_reason == "max_tokens" and m.content[0].type == "text", choice
    # the one forced tool is the only one shown; "none" shows none
    counts = {name: client(gw).messages.count_tokens(
        model=MODEL, messages=ROUND_TRIP, tools=[WEATHER, {**WEATHER, "name": "other"}],
        tool_choice=choice).input_tokens
        for name, choice in (("auto", {"type": "auto"}), ("none", {"type": "none"}),
                             ("tool", {"type": "tool", "name": "other"}))}
    assert counts["none"] < counts["tool"] < counts["auto"]


# errors: Anthropic's body and status, wherever they are raised

@pytest.mark.parametrize("path, body, raw, headers, status, kind", [
    ("/v1/messages", None, b"{not json", None, 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, None,
     None, 400, "invalid_request_error"),  # no max_tokens
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, None, None, 400,
     "invalid_request_error"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, None,
     {"x-api-key": "sk-wrong"}, 401, "authentication_error"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "x"}]}, None,
     {"x-api-key": "sk-wrong"}, 401, "authentication_error"),
    ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "x"}]}, None, None, 404,
     "not_found_error"),
    ("/v1/messages/batches", {}, None, None, 404, "not_found_error"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, None,
     {"Content-Type": "text/plain"}, 415, "invalid_request_error"),
    ("/v1/messages", None, b'{"system": "' + b"x" * (4 << 20) + b'"}', None, 413,
     "invalid_request_error"),  # over --max-body-bytes: aiohttp's refusal, translated
])
def test_errors_have_anthropics_shape(gw, path, body, raw, headers, status, kind):
    got, _, answer = post(gw, path, body, headers, raw)
    assert got == status, answer
    assert set(answer) == {"type", "error"} and answer["type"] == "error"
    assert answer["error"]["type"] == kind and answer["error"]["message"]
    ERROR.validate_python(answer)


def test_sdk_raises_its_own_errors(gw):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(gw, "sk-wrong").messages.create(model=MODEL, max_tokens=5,
                                               messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
        client(gw).messages.create(model=MODEL, max_tokens=5, thinking={
            "type": "enabled", "budget_tokens": 10}, messages=[{"role": "user",
                                                                "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[1\]\.name"):  # chat's check
        client(gw).messages.create(model=MODEL, max_tokens=5, tools=[WEATHER, WEATHER],
                                   messages=[{"role": "user", "content": "x"}])
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token="sk-alpha", max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "x"}]).usage.output_tokens == 1  # Authorization: Bearer
    slow = client(gw, "sk-slow")
    slow.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.RateLimitError) as limited:  # shared code's 429
        slow.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user",
                                                                   "content": "x"}])
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert int(limited.value.response.headers["Retry-After"]) >= 1
    status, _, answer = post(gw, "/v1/messages", method="GET", raw=b"")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error"
    status, _, answer = post(gw, "/v1/chat/completions", {"messages": "x"})  # chat: OpenAI's
    assert status == 400 and set(answer) == {"error"} and "param" in answer["error"]


def test_error_middleware_translates_on_anthropics_routes_only():
    """The gateway's 503 (draining, not ready, a store down) is Anthropic's 529
    overloaded_error with its Retry-After; an unhandled failure is a 500 api_error; other
    routes keep OpenAI's body."""
    app = web.Application()
    app[STATE] = SimpleNamespace(metrics=None)

    async def draining(_):
        raise APIError(503, "the server is shutting down", "server_error",
                       headers={"Retry-After": "2"})

    async def broken(_):
        raise RuntimeError("a bug")

    def answer(path, handler):
        response = asyncio.run(error_middleware(make_mocked_request("POST", path, app=app),
                                                handler))
        return response.status, response.headers, json.loads(response.body)

    status, headers, body = answer("/v1/messages", draining)
    assert status == 529 and headers["Retry-After"] == "2"
    assert body["error"]["type"] == "overloaded_error"
    ERROR.validate_python(body)
    status, _, body = answer("/v1/messages/count_tokens", broken)
    assert status == 500 and body == {"type": "error", "error": {
        "type": "api_error", "message": "internal server error"}}
    status, _, body = answer("/v1/chat/completions", draining)
    assert status == 503 and body["error"]["type"] == "server_error" and "param" in body["error"]


def test_status_mapping():
    assert error_status(503) == 529 and error_body(503, "m")["error"]["type"] == \
        "overloaded_error"
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (402, "billing_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "invalid_request_error"),
                         (429, "rate_limit_error"), (500, "api_error"), (502, "api_error")):
        assert error_status(status) == status
        ERROR.validate_python(error_body(status, "m"))
        assert error_body(status, "m")["error"]["type"] == kind


# the translation, without a server

def _body(**fields):
    return {"max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER], **fields}


def _events_of(body: dict, pieces: list[str], finish="stop", parser=None):
    call = parse_messages_request(body)
    chat = parse_chat_request(call.chat)
    events = MessageEvents(message_shell("msg_x", MODEL), tool_reader(chat.tools),
                           10, reasoning_split_for(parser))
    out = events.opening()
    for piece in pieces:
        out += events.delta(piece)
    usage = {"input_tokens": 10, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0, "output_tokens": 7}
    out += events.closing(finish, None, usage)  # type: ignore[arg-type]
    whole = content_blocks("".join(pieces), tool_reader(chat.tools), reasoning_split_for(parser))
    return out, whole


def _splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("choice, text", [
    ({"type": "auto"}, 'Sure. <tool_call>{"name": "get_weather", "arguments": '
                       '{"city": "Paris"}}</tool_call>'),
    ({"type": "any", "disable_parallel_tool_use": True},
     '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ({"type": "tool", "name": "get_weather"},
     '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
])
def test_tool_use_events_split_at_every_boundary(choice, text):
    for pieces in _splits(text):
        events, whole = _events_of(_body(tool_choice=choice), pieces)
        message = rebuilt(events)
        assert message.stop_reason == "tool_use"
        assert [b.model_dump(exclude_none=True) for b in message.content] == \
            [{**b, **({"id": message.content[i].id} if b["type"] == "tool_use" else {})}
             for i, b in enumerate(whole)]
        call = message.content[-1]
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
        assert "input_json_delta" in kinds


def test_thinking_blocks_split_at_every_boundary():
    text = "<think>\nIt is sunny there.\n</think>\n\nIt is sunny."
    for pieces in _splits(text):
        events, whole = _events_of(_body(tools=None, thinking={"type": "enabled",
                                                               "budget_tokens": 32}),
                                   pieces, parser="deepseek-r1")
        message = rebuilt(events)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "It is sunny there."
        assert message.content[1].text == "It is sunny." and message.stop_reason == "end_turn"
        assert [b.model_dump(exclude_none=True) for b in message.content] == whole


def test_request_translation():
    call = parse_messages_request(_body(
        system="Sys", stop_sequences=["END"], metadata={"user_id": "u-7"}, top_k=5,
        thinking={"type": "enabled", "budget_tokens": 16}, stream=True,
        messages=ROUND_TRIP))
    chat = call.chat
    assert chat["stop"] == ["END"] and chat["user"] == "u-7" and chat["top_k"] == 5
    assert chat["max_reasoning_tokens"] == 16 and chat["stream"] is True and call.stream
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool",
                                                     "user"]
    assert call.sources == ("system", "messages[0]", "messages[1]", "messages[2]",
                            "messages[2]")
    assert parse_chat_request(chat).user == "u-7"
    off = parse_messages_request(_body(thinking={"type": "disabled"})).chat
    assert off["max_reasoning_tokens"] == 0
    adaptive = parse_messages_request(_body(thinking={"type": "adaptive"}, output_config={
        "effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}))
    assert "max_reasoning_tokens" not in adaptive.chat
    assert adaptive.chat["reasoning_effort"] == "low"
    assert adaptive.chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert adaptive.renamed(APIError(400, "response_format.json_schema.schema is bad",
                                     param="response_format.json_schema.schema")).param == \
        "output_config.format"
    assert "max_reasoning_tokens" not in parse_count_tokens_request(
        {"messages": ROUND_TRIP, "thinking": {"type": "disabled"}}).chat
    renamed = call.renamed(APIError(400, "messages[3].content is bad",
                                    param="messages[3].content"))
    assert renamed.param == "messages[2]" and renamed.message == "messages[2] is bad"
    with pytest.raises(APIError, match=r"tools\[0\]\.input_schema"):
        parse_messages_request(_body(tools=[{**WEATHER, "input_schema": {"type": "array"}}]))
    with pytest.raises(APIError, match="prefilled") as caught:
        parse_messages_request(_body(messages=ROUND_TRIP[:2]))
    assert caught.value.param == "messages[1]"
    with pytest.raises(APIError, match="server tool"):
        parse_messages_request(_body(tools=[{"type": "web_search_20250305",
                                             "name": "web_search"}]))
    assert matched_stop(" The fox", " The ", ("x", "fox")) == "fox"
    assert matched_stop(" The end", " The end", ("fox",)) is None


def test_openapi_lists_the_routes_and_describes_the_answers(gw):
    doc = json.loads(gw.get("/openapi.json")[1])
    post_ = doc["paths"]["/v1/messages"]["post"]
    assert {"x-api-key": []} in post_["security"] and "529" in post_["responses"]
    assert doc["paths"]["/v1/messages/count_tokens"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"].endswith("/CountTokensRequest")
    schemas = doc["components"]["schemas"]
    assert {"max_tokens", "messages", "stop_sequences", "tools", "tool_choice", "thinking",
            "metadata"} <= set(schemas["MessagesRequest"]["properties"])
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    _, _, answer = post(gw, "/v1/messages", {"max_tokens": 3, "messages": [
        {"role": "user", "content": "Hi"}]})
    jsonschema.validate(answer, {**doc, "$ref": "#/components/schemas/Message"})
    _, _, error = post(gw, "/v1/messages", {"messages": []})
    jsonschema.validate(error, {**doc, "$ref": "#/components/schemas/AnthropicError"})


def test_fuzzed_bodies_never_5xx_and_every_error_is_anthropics(gw):
    """Bodies drawn from the served document's request schemas, some mutated (a field
    retyped, a made-up one added): a 200 Message (or a stream ending in message_stop), a
    token count, or a 4xx in Anthropic's shape; never a 5xx."""
    doc = json.loads(gw.get("/openapi.json")[1])
    defs = doc["components"]["schemas"]
    strategies = {path: mutated(from_schema(defs[name], defs)) for path, name in
                  (("/v1/messages", "MessagesRequest"),
                   ("/v1/messages/count_tokens", "CountTokensRequest"))}
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session())
    seen = {"ok": 0, "4xx": 0}

    async def send(path: str, body: dict):
        async with session.post(gw.url + path, json=body, headers={"x-api-key": "sk-alpha"},
                                timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.read()

    @settings(max_examples=80, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(strategies)).flatmap(
        lambda p: st.tuples(st.just(p), strategies[p])))
    def check(case):
        path, body = case
        body.pop("output_config", None)  # a random schema costs a grammar compile each
        status, raw = loop.run_until_complete(send(path, body))
        assert status < 500, (body, raw[:300])
        if status >= 400:
            seen["4xx"] += 1
            ERROR.validate_python(json.loads(raw))
        elif path.endswith("count_tokens"):
            seen["ok"] += 1
            assert json.loads(raw)["input_tokens"] > 0
        elif body.get("stream") is True:
            seen["ok"] += 1
            assert raw.rstrip().endswith(b'data: {"type":"message_stop"}'), raw[-200:]
        else:
            seen["ok"] += 1
            MESSAGE.validate_python(json.loads(raw))

    try:
        check()
    finally:
        loop.run_until_complete(session.close())
        loop.close()
    assert seen["ok"] and seen["4xx"], seen


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


def test_ledger_kind_names_the_api(gw):
    from billing.ledger import KINDS
    from gateway.serving.accounting import ID_KINDS, kind_of

    assert sorted(kind for _, kind in ID_KINDS) == sorted(KINDS)
    assert kind_of("msg_01") == "messages" and kind_of("cmpl-1") == "completions"
    assert kind_of("chatcmpl-1") == "chat" and kind_of("resp_1") == "responses"
    status, headers, _ = post(gw, "/v1/chat/completions", {
        "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and ledger_row(gw, headers["x-request-id"])["kind"] == "chat"


def test_anthropic_components_do_not_shadow_others():
    """Every Anthropic component keeps its own name in the document: one named like another
    component must be that very schema (Cost), else the document would describe another."""
    from gateway.anthropic import schema as declared
    from gateway.http.openapi import _models, _typed
    from gateway.openai.schema.json_schema import components

    ours = {**_models(declared.REQUESTS), **_typed(declared.COMPONENTS, "serialization")}
    theirs = components()
    for name in ours.keys() & theirs.keys():
        assert ours[name] == theirs[name], name
