"""A real gateway process on loopback over the deterministic fake engine."""
import asyncio
import json
import time

import aiohttp
import openai
import pytest

from testkit.gateway_server import GatewayProcess

FAKE_TEXT = " The quick brown fox jumps over the lazy dog and keeps running through the field."


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--fake", "--fake-step-ms", "5", "--max-num-seqs", "8",
                            "--keepalive-seconds", "0.2")
    yield server
    server.stop()


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_chat_non_streaming(client):
    r = client.chat.completions.create(model="fake-smollm2", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert r.choices[0].message.content == " The quick brown fox"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_openai_client_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="fake-smollm2", max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Stream please"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " The quick brown fox jumps over"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_openai_client_completions_both_ways(client):
    r = client.completions.create(model="fake-smollm2", prompt="Once", max_tokens=3, n=2)
    assert [c.text for c in r.choices] == [" The quick brown"] * 2
    assert r.usage.completion_tokens == 6
    stream = client.completions.create(model="fake-smollm2", prompt="Once", max_tokens=3,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == " The quick brown"


def test_stop_string_and_echo(client):
    r = client.completions.create(model="fake-smollm2", prompt="Once", max_tokens=20, stop=[" fox"],
                                  echo=True)
    assert r.choices[0].text == "Once The quick brown"
    assert r.choices[0].finish_reason == "stop"


def test_raw_sse_bytes(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/completions",
                              json={"prompt": "Once", "max_tokens": 2, "stream": True}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert r.headers["Cache-Control"] == "no-cache"
                assert "x-request-id" in r.headers and "x-queue-seconds" in r.headers
                return await r.read(), r.headers["x-request-id"]

    body, rid = asyncio.run(main())
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    created = payloads[0]["created"]
    base = {"id": rid, "object": "text_completion", "created": created, "model": "fake-smollm2"}
    assert payloads == [
        {**base, "choices": [{"index": 0, "text": " The", "logprobs": None,
                              "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "text": " quick", "logprobs": None,
                              "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                              "finish_reason": "length"}]},
    ]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"temperature": -1}', 400, "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"max_tokens": true}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"n": 1000}', 400, "n"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
])
def test_bad_input_gets_openai_error_bodies(gw, path, body, status, param):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + path, data=body,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()
    got_status, payload = asyncio.run(main())
    assert got_status == status
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_too_large_body_unknown_route_and_method(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
            async with s.post(gw.url + "/v1/completions", data=big,
                              headers={"Content-Type": "application/json"}) as r:
                large = (r.status, await r.json())
            async with s.get(gw.url + "/v1/nothing") as r:
                missing = (r.status, await r.json())
            async with s.get(gw.url + "/v1/completions") as r:
                method = (r.status, await r.json())
        return large, missing, method
    large, missing, method = asyncio.run(main())
    assert large[0] == 413 and "error" in large[1]
    assert missing[0] == 404 and missing[1]["error"]["type"] == "not_found_error"
    assert method[0] == 405 and "error" in method[1]


def test_models_health_ready_metrics_openapi(gw):
    status, body = gw.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "fake-smollm2"
    assert gw.get("/health")[0] == 200
    status, body = gw.get("/ready")
    assert status == 200 and json.loads(body)["ready"] is True
    status, body = gw.get("/metrics")
    assert status == 200 and b"vllm:num_requests_running" in body
    spec = json.loads(gw.get("/openapi.json")[1])
    assert "/v1/chat/completions" in spec["paths"] and "/v1/ws" in spec["paths"]


def test_websocket_many_requests_and_cancel(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(gw.url + "/v1/ws") as ws:
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                await ws.send_json({"type": "request", "id": "a", "endpoint": "chat",
                                    "body": chat})
                await ws.send_json({"type": "request", "id": "b", "endpoint": "completions",
                                    "body": {"prompt": "x", "max_tokens": 500}})
                await ws.send_str("not json")
                texts, done, errors = {"a": "", "b": ""}, set(), []
                while len(done) < 2:
                    msg = json.loads((await ws.receive()).data)
                    if msg["type"] == "chunk":
                        choice = msg["data"]["choices"][0]
                        texts[msg["id"]] += choice.get("text") or \
                            choice.get("delta", {}).get("content") or ""
                        if msg["id"] == "b" and len(texts["b"]) > 10:
                            await ws.send_json({"type": "cancel", "id": "b"})
                    elif msg["type"] in ("done", "error"):
                        if msg["id"] is None:
                            errors.append(msg)
                        else:
                            done.add(msg["id"])
                            if msg["id"] == "b":
                                assert msg["type"] == "error"
                                assert msg["error"]["type"] == "cancelled"
                return texts, errors
    texts, errors = asyncio.run(main())
    assert texts["a"] == " The quick brown"
    assert len(errors) == 1 and errors[0]["error"]["type"] == "invalid_request_error"


def _running(gw):
    return gw.metric("vllm:num_requests_running")


def test_disconnect_returns_to_baseline(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/completions",
                                json={"prompt": "x", "max_tokens": 2000, "stream": True})
            await resp.content.readline()  # the first event arrived: it is decoding
            resp.close()  # the client walks away mid-stream
    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_running(gw) or
                                           gw.metric("vllm:kv_cache_usage_perc")):
        time.sleep(0.1)
    assert _running(gw) == 0
    assert gw.metric("vllm:kv_cache_usage_perc") == 0
    assert gw.metric("inferstack:gateway_queue_length") == 0
