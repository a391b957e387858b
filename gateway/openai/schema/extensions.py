"""The bodies beyond OpenAI's chat and completions, declared: vLLM's /tokenize and /detokenize
and the OpenAI Responses API's request.

The tokenize bodies share the chat message, prompt and tool declarations, so a text is read
exactly as for generation. The Responses request declares every field
gateway/openai/responses_api.py reads; its refusals of what we cannot honour (tools, reasoning,
background runs and the like) stay there and run first, each naming its param.

Fields are declared in the order the gateway has always checked them, so a body with several
faults is refused for the same one.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import WithJsonSchema

from gateway.errors import bad_request
from gateway.openai.schema.base import Body, by_kind, refuse, too_long
from gateway.openai.schema.chat import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PRIORITY,
    MAX_TEMPERATURE,
    MIN_PRIORITY,
    Message,
    StopField,
    prompt_value,
)
from gateway.openai.schema.tools import ToolChoice, Tools

MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
# `user` is echoed in the response and stored with it: an end-user id, not a document (OpenAI's
# safety_identifier, its successor, allows 64 characters)
MAX_USER_CHARS = 256


def _text_prompt(value: Any) -> str | None:
    if value is None:
        return None
    prompt = prompt_value(value)
    if isinstance(prompt, tuple):
        raise bad_request("prompt must be a text; token ids are already tokens", "prompt")
    return prompt


TextPrompt = Annotated[Any, AfterValidator(_text_prompt), WithJsonSchema({"oneOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "maxItems": 1,
                         "items": {"type": "string"}}, {"type": "null"}]})]


class TokenizeRequest(Body):
    """Exactly one of prompt (a text) or messages (a chat); tools only with messages."""

    prompt: TextPrompt = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    model: str | None = None
    add_special_tokens: bool | None = Field(None, description="Prompts only: BOS and the like.")
    add_generation_prompt: bool | None = Field(None, description="Chats only (default true).")
    return_token_strs: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_text(cls, data: Any) -> Any:
        # first, as always: which of the two is meant decides how the rest is read
        if isinstance(data, dict):
            has_prompt, has_messages = (data.get("prompt") is not None,
                                        data.get("messages") is not None)
            if has_prompt == has_messages:
                raise bad_request("send exactly one of prompt (a text) or messages (a chat)",
                                  "prompt" if has_messages else "messages")
        return data

    @model_validator(mode="after")
    def _tools_need_messages(self) -> TokenizeRequest:
        if self.messages is None and self.tools:  # a prompt has no turn to offer them in
            raise bad_request("tools are only supported with messages", "tools")
        return self


class DetokenizeRequest(Body):
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description=(
        "At most the served context's length of ids."))
    model: str | None = None

    @field_validator("tokens", mode="before")
    @classmethod
    def _within_context(cls, value: Any, info: ValidationInfo) -> Any:
        # the cap is the served context, known only at run time (read's context): checked
        # before any id is, so an oversized list costs no per-item work
        limit = (info.context or {}).get("max_tokens")
        if limit is not None and isinstance(value, list) and len(value) > limit:
            raise too_long(limit, len(value))
        return value


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


def _metadata(value: dict[str, Any]) -> dict[str, Any]:
    # OpenAI names the whole field for any fault in it, so every check here refuses "metadata"
    if len(value) > MAX_METADATA_KEYS:
        raise refuse(f"allows at most {MAX_METADATA_KEYS} keys, got {len(value)}")
    if any(len(key) > MAX_METADATA_KEY_CHARS for key in value):
        raise refuse(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
    if not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS
               for v in value.values()):
        raise refuse(f"values must be strings of at most {MAX_METADATA_VALUE_CHARS} "
                     "characters")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_metadata), WithJsonSchema({
    "type": "object", "maxProperties": MAX_METADATA_KEYS,
    "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}})]


class ResponsesRequest(Body):
    """OpenAI's Responses API request, and our chat extensions (stop, seed, priority, ...),
    which the chat body it becomes is checked for again, with the model's defaults."""

    # first, as the refusals of their values (gateway/openai/responses_api.py) come first
    text: dict[str, Any] | None = Field(None, description=(
        'Only format {"type": "text"} and verbosity "medium" can be honoured.'))
    reasoning: dict[str, Any] | None = Field(None, description=(
        'An effort other than "none" needs a reasoning model (--reasoning-parser).'))
    input: Annotated[Annotated[str, Tag("~string")]
                     | Annotated[list[InputMessage], Field(min_length=1,
                                                         max_length=MAX_MESSAGES),
                                 Tag("~array")],
                     by_kind("must be a string or a non-empty array of messages")]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["auto", "none"] | None = None
    truncation: Literal["disabled"] | None = None
    model: str | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StopField | None = None
    seed: int | None = None
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] | None = None
