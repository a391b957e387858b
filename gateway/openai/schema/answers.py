"""What the gateway answers, declared as TypedDicts: whole responses, stream chunks, usage,
logprobs, tool calls, errors, the model list, the tokenize answers and the Responses API's
response object.

Why TypedDicts and not models: a stream sends a chunk per token to up to 1,024 clients, and a
TypedDict costs nothing at run time (the builders in gateway/openai/responses.py still make
plain dicts that orjson writes), while mypy checks every builder against these shapes and
/openapi.json describes them (pydantic's TypeAdapter reads TypedDicts).
"""
from __future__ import annotations

from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict

FinishReason = Literal["stop", "length", "tool_calls"] | None


class Cost(TypedDict):
    """The request's price, split as it is billed (only with a price table)."""

    cache_hit_input: float
    cache_miss_input: float
    output: float
    total: float
    currency: str


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # prompt tokens served from the prefix cache (the cache-hit price)


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int  # output tokens a reasoning model wrote inside its think block


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # DeepSeek's names beside OpenAI's: the prompt tokens billed at the cache-hit price
    # (= prompt_tokens_details.cached_tokens) and at the cache-miss price (the rest)
    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int
    completion_tokens_details: NotRequired[CompletionTokensDetails]  # chat
    cost: NotRequired[Cost]


class UsageExtra(TypedDict, total=False):
    """What the gateway adds to OpenAI's usage: the cost, with a price table."""

    cost: Cost


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob]


class CompletionLogprobs(TypedDict):
    """The legacy completions shape: parallel lists, alternatives as {text: logprob}."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CalledFunction(TypedDict):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolCallDelta(TypedDict):
    """The first delta of a call has id, type and name; later ones add pieces of arguments."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: dict[str, str]


class ChatMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None  # null when only tools were called
    # a reasoning model's think block (gateway/openai/reasoning.py), under DeepSeek's name
    # and vLLM's; only with a reasoning parser
    reasoning_content: NotRequired[str | None]
    reasoning: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: NotRequired[list[Any]]  # vLLM's, only when asked for


class ChunkDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str  # a reasoning model's think text (DeepSeek's name)
    reasoning: str  # the same text under vLLM's name
    tool_calls: list[ToolCallDelta]


class ChunkChoice(TypedDict):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: NotRequired[Usage | None]  # with include_usage: null, then the last one's


class CompletionChoice(TypedDict):
    index: int
    text: str | None
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: NotRequired[list[Any]]  # vLLM's, only when asked for


class Completion(TypedDict):
    """A whole completion, and (with usage only on the last) each chunk of a stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(TypedDict):
    error: ErrorDetail


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    parent: None
    max_model_len: int | None
    sampling_defaults: dict[str, float] | None  # what applies to omitted sampling fields


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    count: int  # the prompt tokens a completion with the same body is billed for
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(TypedDict):
    prompt: str


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(TypedDict):
    """A reasoning model's thought (gateway/openai/reasoning.py), before the message."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]  # always empty: the thought is given whole, not summarized
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ReasoningText]


class InputTokensDetails(TypedDict):
    cached_tokens: int
    cache_write_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int
    cost: NotRequired[Cost]


class ResponseError(TypedDict):
    code: str
    message: str


class Response(TypedDict):
    """The Responses API's response object (the fields `fields` of a shell, then its state)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: dict[str, str] | None
    output: list[OutputMessage | ReasoningItem]
    usage: ResponseUsage | None
    completed_at: int | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    user: str | None


# the component schemas of the OpenAPI document, by name
COMPONENTS = (Usage, ChatCompletion, ChatCompletionChunk, Completion, Error, ModelList,
              TokenizeResponse, DetokenizeResponse, Response)
