"""The declared request models (gateway/openai/schema/) accept and refuse exactly what the
gateway's readers do, with the same `param`, and read accepted bodies into the same request.

The corpus is every bad body the reader tests name, plus valid bodies of each shape; both paths
must agree on each (while the readers were written by hand this compared two implementations;
once the readers are the models it pins their behaviour).

The Responses, /tokenize and /detokenize bodies are read through their models too; their corpus
(the bodies their server tests send, and bodies with several faults, refused for the one the
hand-written readers named) pins what each is refused for, without a server."""
from __future__ import annotations

import copy

import pytest

from contract.errors import InvalidRequestError
from contract.sampling_params import check_sampling_fields
from gateway.errors import APIError, from_runtime_error
from gateway.openai import requests as readers
from gateway.openai.responses_api import parse_responses_request
from gateway.openai.schema import read
from gateway.openai.schema.chat import (
    ChatCompletionRequest,
    CompletionRequest,
    generation_fields,
)
from gateway.openai.tokenize_api import parse_detokenize, parse_tokenize
from tests.gateway import test_openai_api as api_tests
from tests.gateway import test_responses_api as responses_tests
from tests.gateway import test_structured_api as structured_tests


def _cases(test, body_of=lambda args: args[0]) -> list[tuple]:
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return [(body_of(args), args[1]) for args in mark.args[1]]


def _chat(fields: dict) -> dict:
    return {"messages": structured_tests.USER, **fields}


VALID_CHAT = [
    api_tests.CHAT,
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "developer", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]},
                  {"role": "user", "content": "x", "name": "ignored"}],
     "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
     "top_k": -1, "min_p": 0.1, "seed": -3, "presence_penalty": 1, "stop": "\n",
     "stop_token_ids": [1, 2], "ignore_eos": True, "n": 2, "stream": True,
     "stream_options": {"include_usage": True}, "priority": -5, "user": "u",
     "logprobs": True, "top_logprobs": 3, "unknown_field": [1, 2]},
    _chat({"tools": [], "logit_bias": {}, "response_format": {"type": "text"}, "best_of": 1,
           "stream_options": {}, "prompt_logprobs": 2, "functions": None}),
    _chat({"tools": [structured_tests.WEATHER], "tool_choice": "required"}),
    _chat({"tools": [structured_tests.WEATHER, structured_tests.tool("g", {})],
           "tool_choice": {"type": "function", "function": {"name": "g"}},
           "parallel_tool_calls": False}),
    _chat({"tools": [structured_tests.WEATHER], "tool_choice": "none",
           "response_format": {"type": "json_object"}}),
    _chat(structured_tests.json_schema(structured_tests.COLOR, strict=True)),
    _chat(structured_tests.json_schema(None)),
    _chat({"structured_outputs": {"choice": ["a", "b", "a"], "backend": "x"}}),
    _chat({"structured_outputs": {"json": "{\"type\": \"object\"}"}}),
    _chat({"structured_outputs": {"json_object": True}}),
    _chat({"guided_regex": "[a-z]+"}), _chat({"guided_grammar": "root ::= \"a\""}),
    _chat({"guided_json": structured_tests.PYDANTIC}),
    {"messages": [*structured_tests.USER,
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "9C"},
                  {"role": "assistant", "content": "ok", "tool_calls": []}]},
]
VALID_COMPLETION = [
    api_tests.COMPLETION, {"prompt": [1, 2, 3]}, {"prompt": ["one"]}, {"prompt": [[4, 5]]},
    {"prompt": "x", "logprobs": 0, "echo": True, "max_tokens": 3, "stop": ["a", "b"],
     "suffix": "", "tools": []},
]
CHAT_CASES = (
    [(body, None) for body in VALID_CHAT] + api_tests.BAD_CHAT
    + _cases(structured_tests.test_bad_constraints_are_400_naming_the_param,
             lambda args: _chat(args[0]))
    + _cases(structured_tests.test_bad_tools_are_400_naming_the_param,
             lambda args: _chat(args[0]))
    + _cases(structured_tests.test_bad_calls_and_results_are_400)
    + [({"messages": [{"role": "user", "content": "x"}] * 3000}, "messages"),
       (_chat({"stop": ["a"] * 17}), "stop"), ({"messages": [{"role": 5}]}, "messages[0].role"),
       (_chat({"tool_choice": {"type": "function", "function": "f"}}),
        "tool_choice.function.name"),
       (_chat({"stream_options": {"x": 1}}), "stream_options"),
       (_chat({"stream": True, "prompt_logprobs": 1}), "prompt_logprobs")])
COMPLETION_CASES = [(body, None) for body in VALID_COMPLETION] + api_tests.BAD_COMPLETION + [
    ({"prompt": "x", "tools": [structured_tests.WEATHER]}, "tools"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice")]


def _by_readers(kind: str, body: dict):
    return readers.parse_request(kind, body)


def _by_models(kind: str, body: dict) -> dict:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    fields = generation_fields(read(model, body), readers.NO_DEFAULTS)
    try:
        check_sampling_fields(fields["sampling"])
    except InvalidRequestError as exc:
        raise from_runtime_error(exc) from None
    return fields


def _outcome(parse, kind: str, body: dict):
    try:
        return "accepted", parse(kind, copy.deepcopy(body))
    except APIError as exc:
        return "refused", (exc.status, exc.param, exc.code)


@pytest.mark.parametrize("kind,body,param", [("chat", *case) for case in CHAT_CASES]
                         + [("completion", *case) for case in COMPLETION_CASES])
def test_models_and_readers_agree(kind, body, param):
    old_verdict, old = _outcome(_by_readers, kind, body)
    new_verdict, new = _outcome(_by_models, kind, body)
    assert old_verdict == new_verdict == ("accepted" if param is None else "refused"), (old, new)
    if new_verdict == "refused":
        assert old == new and new[1] == param
        return
    got = {name: getattr(old, name) for name in new if name != "sampling"}
    assert got == {name: value for name, value in new.items() if name != "sampling"}
    assert dict(old.sampling) == new["sampling"]


def test_the_caps_are_the_readers():
    from gateway.openai.schema import chat
    for name in ("MAX_N", "MAX_MESSAGES", "MAX_CONTENT_PARTS", "ROLES", "MAX_TEMPERATURE",
                 "MIN_PRIORITY", "MAX_PRIORITY"):
        assert getattr(chat, name) == getattr(readers, name), name


# the Responses API and /tokenize, /detokenize

def _responses(body: dict):
    """As the route reads a body: the Responses request, then its chat body (its faults
    named by the Responses param they came from)."""
    req = parse_responses_request(body)
    try:
        return readers.parse_chat_request(req.chat_body(()))
    except APIError as exc:
        raise req.renamed(exc, 0) from None


RESPONSES_CASES = [  # (body, the param it is refused for; None: accepted)
    ({"input": "x"}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "message", "role": "assistant", "content": "b"}],
      "instructions": "i", "metadata": {"k": "v"}, "store": False, "stream": True,
      "tool_choice": "none", "truncation": "disabled", "text": {"format": {"type": "text"}},
      "reasoning": {"effort": "none"}, "temperature": 0.5, "stop": ["."], "seed": 3}, None),
    ({"input": "x", "tools": [], "include": [], "background": False, "text": None}, None),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "truncation": "auto"},
     "truncation"),
    ({"input": 5, "text": "plain"}, "text"), ({"input": 5, "tools": [1]}, "tools"),
    ({"input": 5, "store": "x"}, "input"), ({"input": "x", "store": "x", "stream": 1}, "store"),
    ({"input": [{"type": "x", "role": "tool"}]}, "input[0].type"),
    ({"input": "x", "stop": 5}, "stop"), ({"input": "x", "seed": "1"}, "seed"),
] + [(body, param) for body, param, code in responses_tests.BAD
     if code in (None, "array_too_long") and isinstance(body, dict)]  # others: admission's


@pytest.mark.parametrize("body,param", RESPONSES_CASES)
def test_responses_bodies(body, param):
    verdict, got = _outcome(lambda _, b: _responses(b), "responses", body)
    assert verdict == ("accepted" if param is None else "refused"), got
    if param is not None:
        assert got[:2] == (400, param), got


CHAT = [{"role": "user", "content": "hi"}]
WEATHER = structured_tests.WEATHER
TOKENIZE_CASES = [
    ({"prompt": "x"}, None), ({"prompt": ["x"]}, None), ({"prompt": ""}, None),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "model": "m",
      "add_generation_prompt": False, "return_token_strs": True}, None),
    ({}, "messages"), ({"prompt": "x", "messages": CHAT}, "prompt"),
    ({"prompt": None, "messages": None}, "messages"),
    ({"prompt": [1, 2]}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}] * 3000}, "messages"),
    ({"messages": []}, "messages"), ({"prompt": "x", "return_token_strs": "yes"},
                                     "return_token_strs"),
    ({"messages": CHAT, "tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"prompt": "x", "tools": [WEATHER]}, "tools"), ({"prompt": "x", "tools": 5}, "tools"),
    ({"prompt": "x", "tool_choice": 5}, "tool_choice"),  # declared, so checked with a prompt too
    ({"prompt": 5, "model": 5}, "prompt"), ({"prompt": 5, "tools": [WEATHER]}, "prompt"),
    ({"messages": [{"role": "x"}], "model": 5}, "messages[0].role"),
    ({"prompt": "x", "model": 5, "add_special_tokens": 1}, "model"),
]


@pytest.mark.parametrize("body,param", TOKENIZE_CASES)
def test_tokenize_bodies(body, param):
    verdict, got = _outcome(lambda _, b: parse_tokenize(b), "tokenize", body)
    assert verdict == ("accepted" if param is None else "refused"), got
    if param is not None:
        assert got[:2] == (400, param), got
    else:  # the text is read exactly as the generation endpoint reads it
        kind = "chat" if "messages" in body else "completion"
        text = {k: body[k] for k in ("prompt", "messages", "tools", "tool_choice") if k in body}
        assert got.request == readers.parse_request(kind, text)


@pytest.mark.parametrize("body,param,code", [
    ({"tokens": [0, 5]}, None, None), ({"tokens": []}, None, None),
    ({}, "tokens", None), ({"tokens": None}, "tokens", None), ({"tokens": "abc"}, "tokens", None),
    ({"tokens": [-1]}, "tokens", None), ({"tokens": [True]}, "tokens", None),
    ({"tokens": [1] * 11}, "tokens", "array_too_long"),
    ({"tokens": ["a"] * 11}, "tokens", "array_too_long"),  # the cap before the items
    ({"tokens": [1], "model": 5}, "model", None), ({"tokens": "x", "model": 5}, "tokens", None),
])
def test_detokenize_bodies(body, param, code):
    verdict, got = _outcome(lambda _, b: parse_detokenize(b, 10), "detokenize", body)
    assert verdict == ("accepted" if param is None else "refused"), got
    if param is not None:
        assert got == (400, param, code)
