"""Anthropic's Messages API on the real SmolLM2 model, through the official anthropic SDK,
unchanged: a forced tool call streamed (every event parsed by the SDK's own types, the call's
input valid for the tool), then the tool round trip (tool_use, tool_result) answered in text,
and count_tokens equal to what that answer was billed as input."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from testkit.gateway_server import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.model
EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
               "required": ["city"], "additionalProperties": False}}
ASK = {"role": "user", "content": "What is the weather like in Tokyo right now?"}
GREEDY = {"temperature": 0}  # older SDKs' field, sent as the body's


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--kv-cache-gb", "0.25", "--max-num-seqs", "4")
    yield server
    server.stop()


def test_tool_use_streamed_then_the_round_trip(gw):
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=[ASK], tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        types = []
        for event in stream:  # the SDK parsed each one into its own event types
            types.append(event.type)
            if event.type in ("message_start", "content_block_start", "content_block_delta",
                              "content_block_stop", "message_delta", "message_stop"):
                EVENT.validate_python(event.model_dump())
        call = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert call.stop_reason == "tool_use", call
    use = call.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])

    conversation = [ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                           for b in call.content]},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": use.id,
                                                  "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=24, messages=conversation,
                                    tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    count = client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER],
                                         tool_choice={"type": "none"})
    assert count.input_tokens == answer.usage.input_tokens + \
        answer.usage.cache_read_input_tokens
