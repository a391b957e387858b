"""Request parsing (what is accepted, what is refused and why) and the exact OpenAI shapes built."""
from __future__ import annotations

import subprocess
import sys

import pytest

from contract.errors import InvalidRequestError, PromptTooLongError
from contract.sampling_params import SamplingParams
from gateway.errors import APIError, error_body, from_runtime_error
from gateway.openai.requests import (
    ChoiceResult,
    LogprobToken,
    StreamChunker,
    chat_chunk,
    chat_response,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    parse_request,
    usage_dict,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "Once upon"}


def chat(**fields):
    return {**CHAT, **fields}


def completion(**fields):
    return {**COMPLETION, **fields}


# valid bodies

def test_chat_body_parses_into_request_and_params():
    req = parse_chat_request({
        "model": "smol", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}],
        "max_tokens": 50, "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9,
        "top_k": 40, "min_p": 0.05, "seed": 7, "stop": ["\n", "END"], "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "n": 3, "logprobs": True,
        "top_logprobs": 5, "user": "u1", "priority": -5, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "some_new_field": 1})
    assert req.kind == "chat" and req.model == "smol" and req.prompt is None
    assert req.messages == ({"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"})
    assert (req.max_tokens, req.n, req.stream, req.include_usage) == (20, 3, True, True)
    assert (req.priority, req.user, req.echo) == (-5, "u1", False)
    assert req.sampling_params(req.max_tokens) == SamplingParams(
        max_tokens=20, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        stop=("\n", "END"), ignore_eos=True, logprobs=True, top_logprobs=5)


def test_defaults_leave_max_tokens_to_the_gateway():
    req = parse_chat_request(CHAT)
    assert req.max_tokens is None
    assert (req.n, req.stream, req.include_usage, req.priority, req.user) == (1, False, False,
                                                                              0, None)
    assert req.sampling_params(300) == SamplingParams(max_tokens=300)


def test_sampling_params_budget_below_one_is_a_400():
    with pytest.raises(APIError) as err:
        parse_chat_request(CHAT).sampling_params(0)
    assert (err.value.status, err.value.param) == (400, "max_tokens")


def test_completion_body_parses_with_integer_logprobs_and_echo():
    req = parse_completion_request(completion(max_tokens=8, logprobs=3, echo=True, stop="."))
    assert (req.kind, req.prompt, req.messages, req.echo, req.max_tokens) == (
        "completion", "Once upon", None, True, 8)
    assert req.sampling_params(req.max_tokens) == SamplingParams(
        max_tokens=8, stop=(".",), logprobs=True, top_logprobs=3)


def test_completion_logprobs_zero_means_sampled_token_only():
    sampling = parse_completion_request(completion(logprobs=0)).sampling
    assert (sampling["logprobs"], sampling["top_logprobs"]) == (True, 0)
    assert parse_completion_request(COMPLETION).sampling["logprobs"] is False


@pytest.mark.parametrize("prompt,expected", [
    ("text", "text"), ([1, 2, 3], (1, 2, 3)), (["one"], "one"), ([[4, 5]], (4, 5)), ("", "")])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


def test_content_parts_are_joined_and_roles_kept():
    req = parse_chat_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "ignored"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "t1"}]})
    assert req.messages == ({"role": "developer", "content": "a\nb"},
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": ""},
                            {"role": "tool", "content": "42", "tool_call_id": "t1"})


def test_harmless_defaults_of_unsupported_fields_pass():
    parse_chat_request(chat(tools=[], logit_bias={}, response_format={"type": "text"},
                            best_of=1, tool_choice="none"))


def test_parse_request_dispatches_on_kind():
    assert parse_request("chat", CHAT).kind == "chat"
    assert parse_request("completion", COMPLETION).kind == "completion"


# bad bodies: each a 400 naming the param

BAD_CHAT = [
    (chat(temperature=True), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature=-0.1), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=float("nan")), "top_p"),
    (chat(min_p=10 ** 400), "min_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=2.0), "top_k"),
    (chat(top_k=-2), "top_k"),
    (chat(min_p=2), "min_p"),
    (chat(seed=True), "seed"),
    (chat(seed=1 << 64), "seed"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_completion_tokens=-1), "max_completion_tokens"),
    (chat(n=0), "n"),
    (chat(n=9), "n"),
    (chat(n=True), "n"),
    (chat(n=2.0), "n"),
    (chat(stop=5), "stop"),
    (chat(stop=["ok", 3]), "stop"),
    (chat(stop=[""]), "stop"),
    (chat(stop=[str(i) for i in range(17)]), "stop"),
    (chat(stop_token_ids=[-1]), "stop_token_ids"),
    (chat(stop_token_ids=[True]), "stop_token_ids"),
    (chat(presence_penalty=3), "presence_penalty"),
    (chat(frequency_penalty=-2.5), "frequency_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(user=5), "user"),
    (chat(model=["a"]), "model"),
    (chat(priority=1001), "priority"),
    (chat(priority=-1001), "priority"),
    (chat(priority=True), "priority"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=True, stream_options=[]), "stream_options"),
    (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (chat(ignore_eos=0), "ignore_eos"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(logit_bias={"1": 5}), "logit_bias"),
    (chat(response_format={"type": "json"}), "response_format.type"),
    (chat(best_of=2), "best_of"),
    ({"messages": None}, "messages"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content[0]"),
]

BAD_COMPLETION = [
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    (completion(logprobs=True), "logprobs"),
    (completion(logprobs=21), "logprobs"),
    (completion(echo="no"), "echo"),
    (completion(suffix="end"), "suffix"),
    (completion(max_tokens=0), "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_bodies_are_400_naming_the_param(body, param):
    with pytest.raises(APIError) as err:
        parse_chat_request(body)
    assert (err.value.status, err.value.type, err.value.param) == (
        400, "invalid_request_error", param), err.value.message


@pytest.mark.parametrize("body,param", BAD_COMPLETION)
def test_bad_completion_bodies_are_400_naming_the_param(body, param):
    with pytest.raises(APIError) as err:
        parse_completion_request(body)
    assert (err.value.status, err.value.param) == (400, param), err.value.message


@pytest.mark.parametrize("body", [None, [], "text", 3, [CHAT]])
def test_non_object_bodies_are_400(body):
    for parse in (parse_chat_request, parse_completion_request):
        with pytest.raises(APIError) as err:
            parse(body)
        assert (err.value.status, err.value.param) == (400, None)


# errors

def test_error_body_and_runtime_error_mapping():
    err = from_runtime_error(PromptTooLongError("prompt of 9000 tokens", param="prompt"))
    assert (err.status, err.code) == (400, "context_length_exceeded")
    assert err.body() == {"error": {"message": "prompt of 9000 tokens",
                                    "type": "invalid_request_error", "param": "prompt",
                                    "code": "context_length_exceeded"}}
    err = from_runtime_error(InvalidRequestError("token id 99999 is out of range", "token_ids"))
    assert (err.status, err.param, err.code) == (400, "token_ids", None)
    assert from_runtime_error(RuntimeError("boom")).body() == error_body(
        "internal server error", "server_error")


# builders

USAGE = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 8},
         "prompt_cache_hit_tokens": 8, "prompt_cache_miss_tokens": 2}  # DeepSeek's names


def test_usage_dict_merges_extra_keys():
    assert usage_dict(10, 8, 4) == USAGE
    assert usage_dict(10, 8, 4, {"cost": 0.5}) == {**USAGE, "cost": 0.5}


TOKENS = (LogprobToken("Hi", -0.25, (("Hi", -0.25), ("Hey", -1.5))),
          LogprobToken("\ufffd", float("-inf"), (), raw=b"\xe2\x82"))


def test_chat_response_shape_with_logprobs():
    body = chat_response("chatcmpl-1", "smol", 1700, [
        ChoiceResult(0, "Hi", "stop", TOKENS), ChoiceResult(1, "Yo", "length")], USAGE)
    assert body == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700, "model": "smol",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi"},
             "logprobs": {"content": [
                 {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
                     {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                     {"token": "Hey", "logprob": -1.5, "bytes": [72, 101, 121]}]},
                 {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xe2, 0x82],
                  "top_logprobs": []}]},
             "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": "Yo"},
             "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE}


def test_completion_response_shape_with_logprobs_after_echo():
    tokens = (LogprobToken(" a", -0.5, ((" a", -0.5), (" b", -0.75), (" a", -3.0))),
              LogprobToken("!", -1.0))
    body = completion_response("cmpl-1", "smol", 1700,
                               [ChoiceResult(0, "Say a!", "stop", tokens, text_offset=3)], USAGE)
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700, "model": "smol",
        "choices": [{"index": 0, "text": "Say a!", "finish_reason": "stop", "logprobs": {
            "tokens": [" a", "!"], "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{" a": -0.5, " b": -0.75}, {}], "text_offset": [3, 5]}}],
        "usage": USAGE}


def test_chat_chunk_shape():
    assert chat_chunk("c", "m", 1, 0, {"content": "x"}, None) == {
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                     "finish_reason": None}]}


def test_chat_stream_sequence_with_usage():
    s = StreamChunker("chat", "c", "m", 1, include_usage=True)
    chunks = [*s.start(0), s.delta(0, "Hel"), s.delta(0, "lo"), s.finish(0, "stop"),
              *s.usage(USAGE)]

    def chunk(delta, finish=None):
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}], "usage": None}
    assert chunks == [
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
        chunk({"content": "lo"}), chunk({}, "stop"),
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "usage": USAGE}]


def test_completion_stream_sequence_tracks_text_offsets():
    s = StreamChunker("cmpl", "k", "m", 2)
    chunks = [*s.start(0), s.delta(0, "ab", [LogprobToken("ab", -0.5)]),
              s.delta(0, "c", [LogprobToken("c", -0.25)]), s.finish(0, "length"),
              *s.usage(USAGE)]

    def chunk(text, logprobs=None, finish=None):
        return {"id": "k", "object": "text_completion", "created": 2, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                             "finish_reason": finish}]}
    assert chunks == [
        chunk("ab", {"tokens": ["ab"], "token_logprobs": [-0.5], "top_logprobs": [{}],
                     "text_offset": [0]}),
        chunk("c", {"tokens": ["c"], "token_logprobs": [-0.25], "top_logprobs": [{}],
                    "text_offset": [2]}),
        chunk("", finish="length")]


def test_openai_sdk_parses_every_shape():
    # the SDK's own models: a missing or mistyped key would fail validation or drop data
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    full = chat_response("c", "m", 1, [ChoiceResult(0, "Hi", "stop", TOKENS)], USAGE)
    parsed = ChatCompletion.model_validate(full)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    assert parsed.choices[0].logprobs.content[1].bytes == [0xe2, 0x82]
    s = StreamChunker("chat", "c", "m", 1, include_usage=True)
    for chunk in [*s.start(0), s.delta(0, "Hi", TOKENS[:1]), s.finish(0, "stop"),
                  *s.usage(USAGE)]:
        ChatCompletionChunk.model_validate(chunk)
    text = completion_response("k", "m", 1, [ChoiceResult(0, "Hi", "length", TOKENS)], USAGE)
    assert Completion.model_validate(text).choices[0].logprobs.text_offset == [0, 2]


def test_gateway_api_does_not_import_torch():
    # in a fresh interpreter: the test session itself has loaded torch through the fixtures
    code = ("import sys, gateway.openai.requests, gateway.http.sse, gateway.http.openapi; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
