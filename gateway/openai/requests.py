"""Parse and validate OpenAI request bodies (chat and legacy completions) into one frozen request.

Input is the already-decoded JSON body, validated by the bodies declared in
`gateway.openai.schema.chat` (the one declaration the OpenAPI document is generated from too).
Anything wrong is an `APIError` (400) whose `param` names the offending field, as OpenAI does.
Unknown fields are ignored, except a few whose silent omission would change the answer
(functions, logit_bias, ...): those are refused, not ignored.

The response shapes live in `gateway.openai.responses` and are re-exported here, so that callers
import the whole OpenAI surface from one module.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from contract.errors import InvalidRequestError
from contract.sampling_params import SamplingParams, check_sampling_fields
from gateway.errors import APIError, from_runtime_error
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
from gateway.openai.schema import read
from gateway.openai.schema.chat import (  # noqa: F401  (the caps, re-exported)
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PRIORITY,
    MAX_TEMPERATURE,
    MIN_PRIORITY,
    ROLES,
    ChatCompletionRequest,
    CompletionRequest,
    generation_fields,
)
from gateway.openai.stream_chunker import StreamChunker  # noqa: F401
from gateway.openai.tools import ToolSpec

# sampling values for the fields a request omits: field name -> value (the model's defaults)
Defaults = Mapping[str, float | int]
NO_DEFAULTS: Defaults = MappingProxyType({})  # OpenAI's own: temperature 1 and nothing else


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
    return generation_request(read(ChatCompletionRequest, body), defaults)


def parse_completion_request(body: Any, defaults: Defaults = NO_DEFAULTS) -> GenerationRequest:
    return generation_request(read(CompletionRequest, body), defaults)


def generation_request(req: ChatCompletionRequest | CompletionRequest,
                       defaults: Defaults = NO_DEFAULTS) -> GenerationRequest:
    """The validated body's request, after the runtime's own check of its sampling fields."""
    fields = generation_fields(req, defaults)
    try:
        check_sampling_fields(fields["sampling"])
    except InvalidRequestError as exc:
        raise from_runtime_error(exc) from None
    return GenerationRequest(**{**fields, "sampling": MappingProxyType(fields["sampling"])})


__all__ = ["APIError", "GenerationRequest", "parse_request", "parse_chat_request",
           "parse_completion_request", "generation_request", "ChoiceResult", "LogprobToken",
           "StreamChunker", "chat_chunk", "chat_logprobs", "chat_response", "chat_usage_chunk",
           "completion_chunk", "completion_logprobs", "completion_response",
           "completion_usage_chunk", "new_id", "usage_dict", "MAX_N", "MAX_MESSAGES",
           "MAX_CONTENT_PARTS", "ROLES"]
