"""Function tools on the chat API, declared: `tools`, `tool_choice`, and the tool calls an
assistant message of the conversation carries.

What each tool_choice does, and the constraint a forced call is generated under, are
gateway/openai/tools.py's; here are the shapes, their caps and the checks on one tool.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StringConstraints, Tag, model_validator
from pydantic.json_schema import WithJsonSchema

from gateway.errors import bad_request
from gateway.openai.schema.base import Body, by_kind, refuse
from gateway.openai.schema.structured import NAME_PATTERN, Name
from gateway.openai.tools import (
    MAX_MESSAGE_TOOL_CALLS,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOLS,
    NO_ARGUMENTS_SCHEMA,
    TOOL_CHOICES,
    Function,
    parameters_problem,
)

CallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
TOOLS_DESCRIPTION = (
    "Function tools. tool_choice \"auto\" (the default) lets the model answer or call; "
    "\"required\" or a named function constrain the output to the call(s). A template "
    "without tool syntax is given the tools in a system message and asked for "
    "`<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>` blocks.")


def _parameters(value: Any) -> dict:
    if value is None or value == {}:  # OpenAI's meaning, and the usual spelling of no arguments
        return NO_ARGUMENTS_SCHEMA()
    why = parameters_problem(value)
    if why is not None:
        raise refuse(why)
    return value


Parameters = Annotated[Any, AfterValidator(_parameters), WithJsonSchema({
    "type": ["object", "null"], "description": "A JSON Schema of type object; omitted or {}: no "
                                     "arguments. `$ref`s must resolve inside it."})]


class FunctionDef(Body):
    name: Name
    description: Annotated[str, StringConstraints(max_length=MAX_TOOL_DESCRIPTION_CHARS)] | \
        None = None
    strict: bool | None = None
    parameters: Parameters = Field(None, validate_default=True)

    def function(self) -> Function:
        return Function(self.name, self.description, self.parameters, self.strict)


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS, description=TOOLS_DESCRIPTION)]


class CalledFunction(Body):
    name: Name
    arguments: str = Field(description="The arguments object as JSON text.")


class ToolCall(Body):
    """A call an assistant message made (and an answer's message.tool_calls)."""

    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name,
                             "arguments": self.function.arguments}}


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_MESSAGE_TOOL_CALLS)]


class NamedToolChoice(Body):
    """Call this function (it must be among tools)."""

    type: Literal["function"]
    function: Annotated[Any, WithJsonSchema({
        "type": ["object", "null"], "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": NAME_PATTERN}}})] = None

    @model_validator(mode="after")
    def _named(self) -> NamedToolChoice:
        function = self.function
        if not isinstance(function.get("name") if isinstance(function, dict) else None, str):
            raise bad_request("tool_choice.function.name must be a string",
                              "tool_choice.function.name")
        return self


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("~string")]
                       | Annotated[NamedToolChoice, Tag("~object")],
                       by_kind(f"must be one of {', '.join(TOOL_CHOICES)} or a named "
                               "function object")]


def choice_value(choice: str | NamedToolChoice | None) -> Any:
    """tool_choice as gateway/openai/tools.py reads it."""
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": choice.function}
    return choice
