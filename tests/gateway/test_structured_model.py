"""Structured outputs and tool calls on the real SmolLM2 model, through the official openai
client (and the WebSocket): a pydantic response_format parsed, and calls for tool_choice
required, named and auto, streamed and not, their arguments valid for the tool."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import aiohttp
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import BaseModel, Field

from testkit.gateway_server import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.model


class Forecast(BaseModel):
    """Small and bounded, so that a 135M model finishes it well within max_tokens."""

    city: Literal["Paris", "London", "Tokyo"]
    sky: Literal["sunny", "cloudy", "rainy"]
    note: str = Field(max_length=12)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Get the local time in a city."""

    city: Literal["Paris", "London", "Tokyo"]


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather"),
         openai.pydantic_function_tool(GetTime, name="get_time")]
ASK = [{"role": "user", "content": "What is the weather like in Tokyo right now?"}]
BASE = dict(model=MODEL, temperature=0, max_tokens=80, tools=TOOLS)


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--kv-cache-gb", "0.25", "--max-num-seqs", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def calls_of(message) -> list[tuple[str, str]]:
    """(name, arguments) of each call, each checked against its tool's parameters."""
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


def both_ways(client, **kwargs):
    """The non-streamed choice and the one the SDK's stream helper rebuilt."""
    whole = client.chat.completions.create(**BASE, **kwargs).choices[0]
    with client.chat.completions.stream(**BASE, **kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert streamed.message.content == whole.message.content
    assert calls_of(streamed.message) == calls_of(whole.message)
    return whole


def test_parse_returns_a_validated_object(client):
    r = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=60, response_format=Forecast,
        messages=[{"role": "user", "content": "Give a short forecast for Paris as JSON."}])
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed


def test_required_call_streamed_and_not(client):
    whole = both_ways(client, messages=ASK, tool_choice="required", parallel_tool_calls=False)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert len(calls_of(whole.message)) == 1


def test_named_call_streamed_and_not(client):
    whole = both_ways(client, messages=ASK, tool_choice={"type": "function",
                                                         "function": {"name": "get_time"}})
    assert whole.finish_reason == "tool_calls"
    assert [name for name, _ in calls_of(whole.message)] == ["get_time"]


def test_smollm2_template_has_no_tool_syntax():
    from runtime.loading.gguf import read_gguf_tokenizer
    from runtime.loading.loader import default_model_path
    assert not read_gguf_tokenizer(default_model_path()).template_knows_tools


def test_auto_call_after_an_earlier_one_streamed_and_not(client):
    """The conversation shows one call and its result (rendered through the fallback, as
    SmolLM2's template has no tool syntax); the model calls again in the same form."""
    earlier = {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"},
                {"role": "assistant", "content": None, "tool_calls": [earlier]},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
                {"role": "assistant", "content": "It is sunny in Paris, 21 C."}, *ASK]
    whole = both_ways(client, messages=messages, tool_choice="auto")
    assert whole.finish_reason == "tool_calls", whole.message.content
    assert calls_of(whole.message)[0][0] == "get_weather"


def test_websocket_stream_rebuilds_the_same_call(gw, client):
    body = dict(messages=ASK, tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**BASE, **body).choices[0]

    async def stream() -> list[dict]:
        async with aiohttp.ClientSession() as s, s.ws_connect(gw.url + "/v1/ws") as ws:
            await ws.send_json({"type": "request", "id": "w", "endpoint": "chat",
                                "body": {**BASE, **body}})
            chunks = []
            while (msg := json.loads((await ws.receive(timeout=300)).data))["type"] != "done":
                assert msg["type"] in ("queued", "chunk"), msg
                chunks += [msg["data"]] if msg["type"] == "chunk" else []
            return chunks

    state = ChatCompletionStreamState()
    for chunk in asyncio.run(stream()):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.current_completion_snapshot.choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert calls_of(streamed.message) == calls_of(whole.message)
