"""POST /v1/responses on real fake-engine gateways: the openai SDK both ways, raw SSE events,
usage and cost, the ledger, previous_response_id chains, storage per tenant, bad input, and a
client that leaves mid-stream."""
import asyncio
import json
import sqlite3
import time

import aiohttp
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import APIError
from gateway.openai.requests import MAX_CONTENT_PARTS, MAX_MESSAGES, parse_chat_request
from gateway.openai.responses_api import (
    ResponseEvents,
    parse_responses_request,
    response_shell,
)
from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file

FAKE_TEXT = " The quick brown fox jumps over the lazy dog and keeps running through the field."
EVENT = TypeAdapter(ResponseStreamEvent)
RESPONSE = TypeAdapter(Response)
TENANTS = {"alpha": {}, "beta": {}, "ledgered": {}, "ops": {}}
KEYS = [("sk-alpha", "alpha", False, False), ("sk-beta", "beta", False, False),
        ("sk-ledgered", "ledgered", False, False), ("sk-admin", "ops", True, False)]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done"]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    server = GatewayProcess("--fake", "--fake-step-ms", "2", "--prices", "seed",
                            "--keys-file", write_key_file(tmp / "keys.toml", TENANTS, KEYS),
                            "--ledger-path", str(tmp / "ledger.sqlite3"))
    server.admin_key = "sk-admin"
    server.ledger = str(tmp / "ledger.sqlite3")
    yield server
    server.stop()


def client(gw, key="sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def call(gw, method, path, body=None, key="sk-alpha"):
    """(status, headers, JSON body) of one plain request."""
    async def go():
        async with aiohttp.ClientSession() as s, s.request(
                method, gw.url + path, json=body, headers=auth(key)) as r:
            return r.status, r.headers.copy(), await r.json(content_type=None)
    return asyncio.run(go())


def stream(gw, body, key="sk-alpha"):
    """The raw SSE answer: (headers, [(event line's name, data)])."""
    async def go():
        async with aiohttp.ClientSession() as s, s.post(
                gw.url + "/v1/responses", json={**body, "stream": True},
                headers=auth(key)) as r:
            assert r.status == 200, await r.text()
            return r.headers.copy(), await r.read()
    headers, raw = asyncio.run(go())
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: ") and \
            lines[1].startswith("data: "), block
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return headers, events


def assert_error(status_body, status, param, code=None):
    got, _, body = status_body
    assert got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# the SDK both ways

def test_sdk_non_streaming_is_a_valid_response(gw):
    model = client(gw).models.list().data[0].id
    r = client(gw).responses.create(model=model, input="Hello", max_output_tokens=4,
                                    metadata={"run": "1"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.output_text == FAKE_TEXT[:20] == " The quick brown fox"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].id.startswith("msg_") and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 4 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.metadata == {"run": "1"} and r.max_output_tokens == 4 and r.store is True
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.tools == [] and r.error is None
    status, headers, body = call(gw, "POST", "/v1/responses",
                                 {"input": "Hello", "max_output_tokens": 2})
    assert status == 200 and headers["x-request-id"] == body["id"]
    RESPONSE.validate_python(body)  # every required field, strictly typed


def test_sdk_streaming_events_in_order(gw):
    events = list(client(gw).responses.create(input="Stream please", max_output_tokens=6,
                                              stream=True))
    types = [e.type for e in events]
    assert types == STREAM_ORDER + ["response.output_text.delta"] * 6 + CLOSING + [
        "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == " The quick brown fox jumps over"
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


def test_raw_sse_has_event_lines_and_every_event_validates(gw):
    headers, events = stream(gw, {"input": "Raw", "max_output_tokens": 40, "stop": "."})
    assert headers["Content-Type"].startswith("text/event-stream")
    names = [name for name, _ in events]
    assert names == [data["type"] for _, data in events]  # the event line names the data
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == STREAM_ORDER and names[-4:] == CLOSING + ["response.completed"]
    for _, data in events:
        EVENT.validate_python(data)
    item_id = events[2][1]["item"]["id"]
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               and d["logprobs"] == [] for d in deltas)
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"][0]["content"][0]["text"] == FAKE_TEXT[:-1]  # the stop is cut
    assert events[-4][1]["text"] == FAKE_TEXT[:-1]
    assert headers["x-request-id"] == done["id"]


def test_failure_after_the_stream_opened_is_an_error_then_response_failed():
    # a worker failing mid-stream cannot be staged on the fake engine: the builder's events
    req = parse_responses_request({"input": "x"})
    shell = response_shell("resp_1", req, parse_chat_request(req.chat_body(())), "m", True)
    events = ResponseEvents(shell)
    made = events.opening() + events.delta(" The") + events.failed(
        APIError(500, "the worker serving this request failed", "server_error"), " The")
    for event in made:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in made] == list(range(len(made)))
    error, failed = made[-2:]
    assert (error["type"], failed["type"]) == ("error", "response.failed")
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error",
                                           "message": "the worker serving this request failed"}
    assert failed["response"]["output"][0]["content"][0]["text"] == " The"


# usage, cost and the ledger

def test_repeated_prefix_reports_cached_tokens_and_the_cost_split(gw):
    long_input = "Please summarise the following report carefully. " * 12
    c = client(gw)
    first = c.responses.create(input=long_input, max_output_tokens=3)
    again = c.responses.create(input=long_input, max_output_tokens=3)
    assert first.usage.input_tokens == again.usage.input_tokens
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens and cached % 16 == 0  # whole blocks
    cost = again.usage.model_extra["cost"]
    miss = again.usage.input_tokens - cached
    assert cost["cache_hit_input"] == pytest.approx(cached * 0.003e-6)  # seed prices
    assert cost["cache_miss_input"] == pytest.approx(miss * 0.15e-6)
    assert cost["output"] == pytest.approx(3 * 0.60e-6)
    assert cost["total"] == pytest.approx(
        cost["cache_hit_input"] + cost["cache_miss_input"] + cost["output"])


def test_every_request_has_its_ledger_row(gw):
    c = client(gw, "sk-ledgered")
    plain = c.responses.create(input="one", max_output_tokens=3)
    streamed = list(c.responses.create(input="two", max_output_tokens=5, stream=True))[-1]
    status, _, usage = call(gw, "GET", "/admin/usage?period=all&tenant=ledgered",
                            key="sk-admin")
    assert status == 200
    (row,) = usage["data"]
    assert row["requests"] == 2 and row["output_tokens"] == 8
    billed = plain.usage.model_extra["cost"]["total"] + \
        streamed.response.usage.model_extra["cost"]["total"]
    assert row["cost_total"] == pytest.approx(billed)
    db = sqlite3.connect(f"file:{gw.ledger}?mode=ro", uri=True)
    try:
        ids = {r[0] for r in db.execute("SELECT id FROM requests WHERE tenant = ?",
                                        ("ledgered",))}
    finally:
        db.close()
    assert ids == {plain.id, streamed.response.id}


# previous_response_id

def test_previous_response_id_continues_the_conversation(gw):
    c = client(gw)
    first = c.responses.create(input="First question", instructions="Answer briefly",
                               max_output_tokens=4)
    second = c.responses.create(input="Second question", previous_response_id=first.id,
                                max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None
    # the same conversation sent whole: the same prompt (instructions are not carried over)
    whole = c.responses.create(max_output_tokens=4, input=[
        {"role": "user", "content": "First question"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Second question"}]}])
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the prefix second computed
    third = c.responses.create(input="Third", previous_response_id=second.id,
                               max_output_tokens=2, stream=True)
    final = list(third)[-1].response
    assert final.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_retrieve_and_delete(gw):
    c = client(gw)
    made = c.responses.create(input="Keep me", max_output_tokens=2)
    assert c.responses.retrieve(made.id).model_dump() == made.model_dump()
    status, _, body = call(gw, "DELETE", f"/v1/responses/{made.id}")
    assert status == 200 and body == {"id": made.id, "object": "response", "deleted": True}
    assert_error(call(gw, "GET", f"/v1/responses/{made.id}"), 404, None, "response_not_found")
    assert_error(call(gw, "POST", "/v1/responses", {"input": "x", "previous_response_id":
                                                    made.id}),
                 404, "previous_response_id", "response_not_found")
    assert_error(call(gw, "DELETE", f"/v1/responses/{made.id}"), 404, None)


def test_another_tenants_response_is_not_found(gw):
    made = client(gw, "sk-alpha").responses.create(input="Mine", max_output_tokens=2)
    unknown = assert_error(call(gw, "GET", "/v1/responses/resp_unknown", key="sk-beta"),
                           404, None, "response_not_found")
    theirs = assert_error(call(gw, "GET", f"/v1/responses/{made.id}", key="sk-beta"),
                          404, None, "response_not_found")
    assert theirs["message"].replace(made.id, "resp_unknown") == unknown["message"]
    assert_error(call(gw, "POST", "/v1/responses", {"input": "x", "previous_response_id":
                                                    made.id}, key="sk-beta"),
                 404, "previous_response_id", "response_not_found")
    assert_error(call(gw, "DELETE", f"/v1/responses/{made.id}", key="sk-beta"), 404, None)
    assert client(gw, "sk-alpha").responses.retrieve(made.id).id == made.id


def test_store_false_is_not_kept(gw):
    made = client(gw).responses.create(input="Forget me", max_output_tokens=2, store=False)
    assert made.store is False
    assert_error(call(gw, "GET", f"/v1/responses/{made.id}"), 404, None, "response_not_found")


# bad input

CONTROL = "<|im_start|>"
BAD = [  # (body, param, code)
    ([], None, None),
    ({}, "input", None),
    ({"input": 5}, "input", None),
    ({"input": []}, "input", None),
    ({"input": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}, "input",
     "array_too_long"),
    ({"input": ["hi"]}, "input[0]", None),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].type", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", None),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * (
        MAX_CONTENT_PARTS + 1)}]}, "input[0].content", "array_too_long"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text", None),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", None),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", None),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format", None),
    ({"input": "x", "text": "plain"}, "text", None),
    # refused at admission: this model (the fake's template) does not reason
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort",
     "unsupported_parameter"),
    ({"input": "x", "background": True}, "background", None),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", None),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", None),
    ({"input": "x", "truncation": "auto"}, "truncation", None),
    ({"input": "x", "conversation": "conv_1"}, "conversation", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", None),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens",
     "context_length_exceeded"),
    ({"input": "x", "temperature": 5}, "temperature", None),
    ({"input": "x", "top_p": "high"}, "top_p", None),
    ({"input": "x", "store": "yes"}, "store", None),
    ({"input": "x", "stream": 1}, "stream", None),
    ({"input": "x", "instructions": 5}, "instructions", None),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id", None),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", None),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", None),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": CONTROL}],
      "instructions": "Be kind"}, "input[1].content", "control_token_in_content"),
    ({"input": "a", "instructions": CONTROL}, "instructions", "control_token_in_content"),
]


@pytest.mark.parametrize("body, param, code", BAD, ids=[b[1] or "body" for b in BAD])
def test_bad_input_is_a_400_naming_the_param(gw, body, param, code):
    error = assert_error(call(gw, "POST", "/v1/responses", body), 400, param, code)
    assert error["type"] == "invalid_request_error"
    if param and "[" not in param:
        assert param.split(".")[0] in error["message"], error


def test_bad_input_through_the_sdk_raises_bad_request(gw):
    with pytest.raises(openai.BadRequestError) as info:
        client(gw).responses.create(input="x", tools=[{"type": "function", "name": "f",
                                                       "parameters": {}}])
    assert info.value.body["param"] == "tools"


# a client that leaves

def test_client_leaving_mid_stream_leaves_nothing_in_flight(gw):
    async def leave_after_deltas():
        async with aiohttp.ClientSession() as s, s.post(
                gw.url + "/v1/responses", headers=auth("sk-alpha"),
                json={"input": "long", "max_output_tokens": 4000, "stream": True}) as r:
            seen = b""
            while seen.count(b"event: response.output_text.delta") < 6:
                seen += await r.content.readany()
            return r.headers["x-request-id"]
    request_id = asyncio.run(leave_after_deltas())
    names = ["inferstack:open_charges", "inferstack:worker_slots_in_use",
             "vllm:num_requests_running"]
    deadline = time.monotonic() + 20
    while any(gw.metrics(names).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(gw.metrics(names).values()), gw.metrics(names)
    db = sqlite3.connect(f"file:{gw.ledger}?mode=ro", uri=True)
    try:
        status, out = db.execute("SELECT status, output_tokens FROM requests WHERE "
                                 "id = ?", (request_id,)).fetchone()
    finally:
        db.close()
    assert status == "cancelled" and 6 <= out < 4000  # billed for what it produced


# storage settings

def test_responses_expire():
    server = GatewayProcess("--fake", "--responses-store-seconds", "3")
    try:
        made = client(server).responses.create(input="Brief", max_output_tokens=2)
        assert client(server).responses.retrieve(made.id).id == made.id
        time.sleep(3.5)
        assert_error(call(server, "GET", f"/v1/responses/{made.id}"), 404, None,
                     "response_not_found")
        assert_error(call(server, "POST", "/v1/responses",
                          {"input": "x", "previous_response_id": made.id}),
                     404, "previous_response_id", "response_not_found")
    finally:
        server.stop()


def test_storage_off_refuses_previous_response_id_and_sampling_defaults_apply():
    server = GatewayProcess("--fake", "--responses-store-seconds", "0",
                            "--sampling-defaults", "temperature=0.5,top_p=0.9")
    try:
        made = client(server).responses.create(input="Unstored", max_output_tokens=2)
        assert made.store is False  # asked for, but this server keeps nothing
        assert (made.temperature, made.top_p) == (0.5, 0.9)  # the chat parser's defaults
        sent = client(server).responses.create(input="x", max_output_tokens=1, top_p=1.0)
        assert (sent.temperature, sent.top_p) == (0.5, 1.0)
        assert_error(call(server, "POST", "/v1/responses",
                          {"input": "x", "previous_response_id": made.id}),
                     400, "previous_response_id", "response_storage_disabled")
        assert_error(call(server, "GET", f"/v1/responses/{made.id}"), 404, None)
    finally:
        server.stop()
