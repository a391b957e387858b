"""The bodies of POST /v1/messages and /v1/messages/count_tokens, declared once (pydantic
models, read by `gateway.openai.schema.read` into the same 400s, and generated into
/openapi.json).

What this server cannot honour is refused by name, never dropped: image, document and
search-result content, Anthropic's server tools (web search, code execution, ...), and a
final assistant message (a prefill, which Anthropic continues: the chat template can only
open a new turn after it). Accepted
and ignored, because they change nothing in the answer: `cache_control` on any block or tool
(our prefix cache is automatic), `citations` settings, `service_tier`, earlier turns'
`thinking` and `redacted_thinking` blocks (Anthropic drops them from the context too).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

import orjson
from pydantic import Field, StringConstraints, Tag, model_validator
from typing_extensions import TypedDict

from contract.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from gateway.errors import bad_request
from gateway.openai.schema.answers import Cost
from gateway.openai.schema.base import Body, by_key, by_kind, refuse
from gateway.openai.schema.chat import MAX_MESSAGES
from gateway.openai.schema.structured import Name
from gateway.openai.schema.tools import Parameters
from gateway.openai.structured_api import MAX_SCHEMA_BYTES
from gateway.openai.tools import (
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOL_SCHEMA_BYTES,
    MAX_TOOLS,
)

MAX_BLOCKS = 256  # content blocks of one message (a turn of many tool results included)
MAX_USER_ID_CHARS = 256
# what a text model cannot read, refused with the reason
UNREADABLE = {"image": "image content is not supported: this server serves a text-only model",
              "document": "document content is not supported: send its text as a text block",
              "search_result": "search_result content is not supported: send its text as a "
                               "text block"}
CallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
CacheControl = Annotated[Any, Field(None, description="Accepted and ignored: the prefix "
                                                      "cache is automatic.")]


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None


class Unreadable(Body):
    """Content a text model cannot read: refused naming its place."""

    type: Literal["image", "document", "search_result"]

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        raise refuse(UNREADABLE[data["type"]])


class ToolUseBlock(Body):
    """A call the assistant made, in the conversation."""

    type: Literal["tool_use"]
    id: CallId
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl = None


ResultPart = Annotated[Annotated[TextBlock, Tag("~text")]
                       | Annotated[Unreadable, Tag("~unreadable")],
                       by_key("type", {"text": "text", "image": "unreadable",
                                       "document": "unreadable",
                                       "search_result": "unreadable"})]
ResultContent = Annotated[Annotated[str, Tag("~string")]
                          | Annotated[list[ResultPart], Field(max_length=MAX_BLOCKS),
                                      Tag("~array")],
                          by_kind("must be a string or an array of text blocks")]


class ToolResultBlock(Body):
    """A tool's result, in the user's turn after the call."""

    type: Literal["tool_result"]
    tool_use_id: CallId
    content: ResultContent | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None

    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "\n".join(
            p.text for p in content or () if isinstance(p, TextBlock))
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Body):
    """An earlier turn's reasoning: accepted and left out of the prompt, as Anthropic does."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Annotated[TextBlock, Tag("~text")]
                  | Annotated[ToolUseBlock, Tag("~tool_use")]
                  | Annotated[ToolResultBlock, Tag("~tool_result")]
                  | Annotated[ThinkingBlock, Tag("~thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("~redacted_thinking")]
                  | Annotated[Unreadable, Tag("~unreadable")],
                  by_key("type", {"text": "text", "tool_use": "tool_use",
                                  "tool_result": "tool_result", "thinking": "thinking",
                                  "redacted_thinking": "redacted_thinking",
                                  "image": "unreadable", "document": "unreadable",
                                  "search_result": "unreadable"})]
Content = Annotated[Annotated[str, Tag("~string")]
                    | Annotated[list[Block], Field(max_length=MAX_BLOCKS), Tag("~array")],
                    by_kind("must be a string or an array of content blocks")]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: Content

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> MessageParam:
        wrong = ((ToolResultBlock, "tool_result") if self.role == "assistant" else
                 (ToolUseBlock, "tool_use"))
        if isinstance(self.content, list) and any(isinstance(b, wrong[0]) for b in self.content):
            raise refuse(f"{wrong[1]} blocks belong in "
                         f"{'user' if self.role == 'assistant' else 'assistant'} messages")
        return self


System = Annotated[Annotated[str, Tag("~string")]
                   | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS), Tag("~array")],
                   by_kind("must be a string or an array of text blocks")]


class ToolParam(Body):
    """A client tool. Anthropic's server tools (a `type` such as web_search_20250305) run on
    Anthropic's side: refused by name."""

    type: Literal["custom"] | None = None
    name: Name
    description: Annotated[str, StringConstraints(max_length=MAX_TOOL_DESCRIPTION_CHARS)] | \
        None = None
    input_schema: Parameters = Field(description="A JSON Schema of type object.")
    cache_control: CacheControl = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise refuse(f"the server tool {str(data['type'])[:64]!r} is not supported: "
                         "only client tools (name, description, input_schema)")
        return data


class AutoChoice(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyChoice(Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedChoice(Body):
    type: Literal["tool"]
    name: Name
    disable_parallel_tool_use: bool | None = None


class NoneChoice(Body):
    type: Literal["none"]


ToolChoice = Annotated[Annotated[AutoChoice, Tag("~auto")] | Annotated[AnyChoice, Tag("~any")]
                       | Annotated[NamedChoice, Tag("~tool")]
                       | Annotated[NoneChoice, Tag("~none")],
                       by_key("type", {"auto": "auto", "any": "any", "tool": "tool",
                                       "none": "none"})]


class ThinkingEnabled(Body):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1, description="The most tokens the reasoning may "
                                                          "take (within max_tokens).")]


class ThinkingDisabled(Body):
    type: Literal["disabled"]


class ThinkingAdaptive(Body):
    """The model thinks as it sees fit (no budget); between_tools alike."""

    type: Literal["adaptive", "between_tools"]
    display: Literal["summarized", "omitted"] | None = Field(None, description="Accepted; "
                                                             "the thinking is returned whole.")


Thinking = Annotated[Annotated[ThinkingEnabled, Tag("~enabled")]
                     | Annotated[ThinkingDisabled, Tag("~disabled")]
                     | Annotated[ThinkingAdaptive, Tag("~adaptive")],
                     by_key("type", {"enabled": "enabled", "disabled": "disabled",
                                     "adaptive": "adaptive", "between_tools": "adaptive"})]


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The answer's JSON Schema: "
                                    "generated under it, as chat's response_format.")


class OutputConfig(Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="A reasoning model's thinking budget, as chat's reasoning_effort.")
    format: OutputFormat | None = None


class Metadata(Body):
    user_id: Annotated[str, StringConstraints(max_length=MAX_USER_ID_CHARS)] | None = Field(
        None, description="The end user: the request's `user`, as chat's.")


class CountTokensRequest(Body):
    """What the prompt is made of: POST /v1/messages/count_tokens takes just this."""

    model: str | None = Field(None, description="A served name (any other is 404); omitted: "
                                                "the first.")
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: System | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_sizes_first(cls, data: Any) -> Any:
        # the schemas' sizes off the raw body, before any schema is checked (about 4 us a
        # byte), as chat does: an oversized body costs O(its size)
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list) and len(tools) <= MAX_TOOLS:
            total = 0
            for i, tool in enumerate(tools):
                schema = tool.get("input_schema") if isinstance(tool, dict) else None
                size = _size(schema) if isinstance(schema, dict) else 0
                if size > MAX_SCHEMA_BYTES:
                    raise bad_request(f"tools[{i}].input_schema is {size} bytes of JSON; at "
                                      f"most {MAX_SCHEMA_BYTES} are allowed",
                                      f"tools[{i}].input_schema")
                total += size
            if total > MAX_TOOL_SCHEMA_BYTES:
                raise bad_request(f"the tools' input schemas are {total} bytes of JSON; at "
                                  f"most {MAX_TOOL_SCHEMA_BYTES} are allowed", "tools")
        return data

    @model_validator(mode="after")
    def _ends_with_the_user(self) -> CountTokensRequest:
        # Anthropic continues a final assistant message (a prefill); the chat template can
        # only open a new turn after it, so the answer would not continue it: refused
        if self.messages[-1].role == "assistant":
            where = f"messages[{len(self.messages) - 1}]"
            raise bad_request(f"{where} is the assistant's: continuing a prefilled answer is "
                              "not supported by this server; end with a user message", where)
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1, description="The output budget (thinking "
                                                       "included).")]
    stop_sequences: Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, description="0 disables.")] | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    service_tier: Annotated[Any, Field(None, description="Accepted and ignored.")] = None

    @model_validator(mode="after")
    def _thinking_within_budget(self) -> MessagesRequest:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise bad_request(f"thinking.budget_tokens ({thinking.budget_tokens}) must be less "
                              f"than max_tokens ({self.max_tokens})", "thinking.budget_tokens")
        return self


def _size(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:  # nested past 255 levels: its own check refuses it
        return 0


__all__ = ["MessagesRequest", "CountTokensRequest", "MessageParam", "ToolParam", "Block",
           "TextBlock", "ToolUseBlock", "ToolResultBlock"]


# the answers (TypedDicts: what the builders return, and the OpenAPI components)

class MessageUsage(TypedDict):
    """What the bill charged: input_tokens are the cache misses, cache_read_input_tokens the
    prefix cache's hits; no token is a billed cache write. `cost` is ours (with prices)."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    cost: NotRequired[Cost]


class TextContent(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseContent(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str


ContentBlock = TextContent | ToolUseContent | ThinkingContent
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(TypedDict):
    input_tokens: int


class AnthropicErrorDetail(TypedDict):
    type: str
    message: str


class ErrorResponse(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorDetail


REQUESTS = (MessagesRequest, CountTokensRequest)
COMPONENTS: dict[str, Any] = {"Message": Message, "TokenCount": TokenCount,
                              "AnthropicError": ErrorResponse}
