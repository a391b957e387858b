"""The bodies beyond OpenAI's chat and completions, declared: vLLM's /tokenize and /detokenize
and the OpenAI Responses API's request.

The tokenize bodies share the chat message and tool declarations; the Responses request
declares the fields gateway/openai/responses_api.py reads (its own refusals, of tools,
reasoning and the like, stay there and name their params).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, Tag

from gateway.openai.schema.base import Body, by_kind
from gateway.openai.schema.chat import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PRIORITY,
    MAX_TEMPERATURE,
    MIN_PRIORITY,
    Message,
    StopField,
)
from gateway.openai.schema.tools import ToolChoice, Tools

MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's


class TokenizeRequest(Body):
    """Exactly one of prompt (a text) or messages (a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    add_special_tokens: bool | None = Field(None, description="Prompts only: BOS and the like.")
    add_generation_prompt: bool | None = Field(None, description="Chats only (default true).")
    return_token_strs: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str


InputContent = Annotated[Annotated[str, Tag("~string")]
                         | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS),
                                   Tag("~array")],
                         by_kind("must be a string or an array of text parts")]


class InputMessage(Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: InputContent


MetadataKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]


class ResponsesRequest(Body):
    """OpenAI's Responses API request, and our chat extensions (stop, seed, priority, ...)."""

    model: str | None = None
    input: Annotated[Annotated[str, Tag("~string")]
                     | Annotated[list[InputMessage], Field(min_length=1,
                                                         max_length=MAX_MESSAGES),
                                 Tag("~array")],
                     by_kind("must be a string or a non-empty array of messages")]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue],
                        Field(max_length=MAX_METADATA_KEYS)] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["auto", "none"] | None = None
    truncation: Literal["disabled"] | None = None
    stop: StopField | None = None
    seed: int | None = None
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] | None = None
