"""Parse and validate OpenAI request bodies (chat and legacy completions) into one frozen request.

Input is the already-decoded JSON body. Anything wrong is an `APIError` (400) whose `param` names
the offending field, as OpenAI does. Unknown fields are ignored, except a few whose silent
omission would change the answer (functions, logit_bias, ...): those are refused, not ignored.
Structured outputs are read by `gateway.openai.structured_api`, tools by `gateway.openai.tools`.

The response shapes live in `gateway.openai.responses` and are re-exported here, so that callers
import the whole OpenAI surface from one module.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from contract.errors import InvalidRequestError
from contract.sampling_params import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    SamplingParams,
    check_sampling_fields,
)
from gateway.errors import APIError, bad_request, from_runtime_error
from gateway.openai.json_fields import (
    check_length,
    is_int,
    read_bool,
    read_int,
    read_int_list,
    read_number,
    read_object,
    read_str,
    read_str_list,
)
from gateway.openai.responses import (  # noqa: F401
    ChoiceResult,
    LogprobToken,
    chat_chunk,
    chat_logprobs,
    chat_response,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    completion_usage_chunk,
    new_id,
    usage_dict,
)
from gateway.openai.stream_chunker import StreamChunker  # noqa: F401
from gateway.openai.structured_api import read_structured
from gateway.openai.tools import ToolSpec, read_message_tool_calls, read_tool_call_id, read_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 8
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_TEMPERATURE = 2.0
# caps on the arrays a client sends, so that no body makes work beyond its size: even an
# empty message renders to a few tokens, so more than this cannot fit any context we serve
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 64
# sampling values for the fields a request omits: field name -> value (the model's defaults)
Defaults = Mapping[str, float | int]
NO_DEFAULTS: Defaults = MappingProxyType({})  # OpenAI's own: temperature 1 and nothing else
# fields that change what the model must produce; ignoring them would return a wrong answer
UNSUPPORTED = ("functions", "logit_bias", "suffix")


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request, independent of the endpoint it came from.

    `sampling` holds every sampling field but the output budget, checked as SamplingParams
    checks them (contract/sampling_params.py) without building one: the budget needs the prompt's
    length. Once the prompt is tokenized the gateway picks it (`max_tokens`, or e.g. the rest of
    the context when the client gave none) and calls `sampling_params(budget)`, once: that one
    object is what the request's record holds and its frames carry.
    """

    kind: str  # "chat" or "completion"
    model: str | None
    messages: tuple[dict, ...] | None  # chat: ({"role": str, "content": str}, ...)
    prompt: str | tuple[int, ...] | None  # completion: text or token ids
    max_tokens: int | None  # None: the client left it to the server
    sampling: Mapping[str, Any]  # every SamplingParams field but max_tokens, read-only
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    priority: int = 0  # lower is more urgent
    user: str | None = None
    echo: bool = False  # completion: prepend the prompt to the output
    # the output constraint (gateway/openai/structured_api.py), as params.structured has it:
    # the body's own, or a required or named tool call's schema
    structured: dict | None = None
    tools: ToolSpec | None = None  # chat: the request's tools and tool_choice

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The runtime's parameters with this output budget (a 400 naming max_tokens if < 1)."""
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except InvalidRequestError as exc:
            raise from_runtime_error(exc) from None


def parse_request(kind: str, body: Any, defaults: Defaults = NO_DEFAULTS) -> GenerationRequest:
    """Dispatch on the endpoint: "chat" (/v1/chat/completions) or "completion" (/v1/completions).

    `defaults` fill the sampling fields the body omits (the model's, contract/sampling_defaults.py);
    a field the body sends, even at OpenAI's default value, is taken as sent."""
    if kind == "chat":
        return parse_chat_request(body, defaults)
    if kind == "completion":
        return parse_completion_request(body, defaults)
    raise ValueError(f"unknown request kind {kind!r}")  # a caller's bug, not the client's


def parse_chat_request(body: Any, defaults: Defaults = NO_DEFAULTS) -> GenerationRequest:
    body = _require_object(body)
    messages = _read_messages(body)
    # max_completion_tokens is the newer name; when both are sent it wins, as in OpenAI's API
    max_tokens = read_int(body, "max_tokens", None, lo=1)
    max_tokens = read_int(body, "max_completion_tokens", max_tokens, lo=1)
    logprobs = read_bool(body, "logprobs", False)
    top_logprobs = read_int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    return _build(body, "chat", max_tokens, logprobs, top_logprobs, defaults, messages=messages)


def parse_completion_request(body: Any, defaults: Defaults = NO_DEFAULTS) -> GenerationRequest:
    body = _require_object(body)
    prompt = _read_prompt(body)
    max_tokens = read_int(body, "max_tokens", None, lo=1)
    # here logprobs is an integer: the sampled token's logprob plus that many alternatives
    top_logprobs = read_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    echo = read_bool(body, "echo", False)
    return _build(body, "completion", max_tokens, top_logprobs is not None, top_logprobs or 0,
                  defaults, prompt=prompt, echo=echo)


def _build(body: dict, kind: str, max_tokens: int | None, logprobs: bool, top_logprobs: int,
           defaults: Defaults, **fields) -> GenerationRequest:
    """The fields both endpoints share, then the runtime's own validation of the sampling ones."""
    _reject_unsupported(body, kind)
    tools = read_tools(body) if kind == "chat" else None
    structured = _constraint(body, tools)
    stream = read_bool(body, "stream", False)
    stream_options = read_object(body, "stream_options")
    if stream_options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if stream and body.get("prompt_logprobs") is not None:  # as vLLM: they come in one piece
        raise bad_request("prompt_logprobs are not available when stream is true",
                          "prompt_logprobs")
    sampling = _sampling_fields(body, logprobs, top_logprobs, defaults, structured)
    return GenerationRequest(
        kind=kind, model=read_str(body, "model", None), max_tokens=max_tokens, sampling=sampling,
        messages=fields.get("messages"), prompt=fields.get("prompt"),
        n=read_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream,
        include_usage=read_bool(stream_options, "include_usage", False,
                                param="stream_options.include_usage"),
        priority=read_int(body, "priority", 0, lo=MIN_PRIORITY, hi=MAX_PRIORITY),
        user=read_str(body, "user", None), echo=fields.get("echo", False),
        structured=structured, tools=tools)


def _constraint(body: dict, tools: ToolSpec | None) -> dict | None:
    """The one output constraint: the body's own, or the call a tool_choice forces."""
    structured = read_structured(body)
    if tools is not None and tools.choice != "none" and structured is not None:
        # a constraint on the whole output leaves no room for a call, and a forced call none
        # for the format: refused rather than one silently winning
        param = structured["param"].split(".")[0]
        raise bad_request(f"{param} cannot be combined with tools unless tool_choice is "
                          "\"none\"", param)
    if tools is not None and tools.constrained:
        structured = tools.constraint()
    return structured


def _sampling_fields(body: dict, logprobs: bool, top_logprobs: int, defaults: Defaults,
                     structured: dict | None = None) -> Mapping[str, Any]:
    # types and our own bounds here; check_sampling_fields the rest, naming the same params
    def default(name: str, openai: float) -> Any:
        return defaults.get(name, openai)

    kwargs: dict[str, Any] = dict(
        temperature=read_number(body, "temperature", default("temperature", 1.0), lo=0.0,
                                hi=MAX_TEMPERATURE),
        top_p=read_number(body, "top_p", default("top_p", 1.0)),
        top_k=read_int(body, "top_k", default("top_k", 0)),
        min_p=read_number(body, "min_p", default("min_p", 0.0)),
        seed=read_int(body, "seed", None, lo=MIN_SEED, hi=MAX_SEED),
        presence_penalty=read_number(body, "presence_penalty", 0.0),
        frequency_penalty=read_number(body, "frequency_penalty", 0.0),
        repetition_penalty=read_number(body, "repetition_penalty",
                                       default("repetition_penalty", 1.0)),
        stop=read_str_list(body, "stop", MAX_STOP_STRINGS),
        stop_token_ids=read_int_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        ignore_eos=read_bool(body, "ignore_eos", False),
        logprobs=logprobs, top_logprobs=top_logprobs,
        prompt_logprobs=read_int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS),
        structured=structured)
    try:
        check_sampling_fields(kwargs)
    except InvalidRequestError as exc:
        raise from_runtime_error(exc) from None
    return MappingProxyType(kwargs)


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _reject_unsupported(body: dict, kind: str) -> None:
    for name in UNSUPPORTED:
        if body.get(name):  # absent, null, empty: harmless
            raise bad_request(f"{name} is not supported by this server", name)
    if kind != "chat" and body.get("tools"):  # no messages here to carry calls and results
        raise bad_request("tools are only supported on /v1/chat/completions", "tools")
    if body.get("best_of") not in (None, 1):
        raise bad_request("best_of is not supported by this server; use n", "best_of")


# chat messages

def _read_messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    check_length("messages", messages, MAX_MESSAGES)
    return tuple(_read_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _read_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r:.40}",
                          f"{where}.role")
    out = {"role": role, "content": _read_content(message.get("content"), role,
                                                  f"{where}.content")}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = read_message_tool_calls(message, where)
    if role == "tool":
        out["tool_call_id"] = read_tool_call_id(message, where)
    return out


def _read_content(content: Any, role: str, where: str) -> str:
    if content is None and role == "assistant":
        return ""  # an assistant turn that only called tools carries no text
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        check_length(where, content, MAX_CONTENT_PARTS)
        # separate parts read as separate paragraphs, as other OpenAI-compatible servers do
        return "\n".join(_read_part(p, f"{where}[{j}]") for j, p in enumerate(content))
    raise bad_request(f"{where} must be a string or an array of text parts", where)


def _read_part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", where)
    if part.get("type") != "text":
        raise bad_request(f"{where}.type must be \"text\"; other content is not supported, "
                          f"got {part.get('type')!r:.40}", f"{where}.type")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return text


# completion prompt

def _read_prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt is just that prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise bad_request("several prompts in one request are not supported; "
                          "send one request per prompt", "prompt")
    raise bad_request("prompt must be a string or a non-empty array of token ids (integers >= 0)",
                      "prompt")


__all__ = ["APIError", "GenerationRequest", "parse_request", "parse_chat_request",
           "parse_completion_request", "ChoiceResult", "LogprobToken", "StreamChunker",
           "chat_chunk", "chat_logprobs", "chat_response", "chat_usage_chunk", "completion_chunk",
           "completion_logprobs", "completion_response", "completion_usage_chunk", "new_id",
           "usage_dict", "MAX_N", "MAX_MESSAGES", "MAX_CONTENT_PARTS", "ROLES"]
