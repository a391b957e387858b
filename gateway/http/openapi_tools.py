"""The OpenAPI schemas of structured outputs and tools: the request fields, the message shapes
that carry calls and results, and the tool calls of answers and stream chunks.

Caps come from the validators' own constants (gateway/openai/structured_api.py, tools.py).
"""
from __future__ import annotations

from gateway.openai.structured_api import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_REGEX_CHARS
from gateway.openai.tools import (
    MAX_MESSAGE_TOOL_CALLS,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOLS,
    TOOL_CHOICES,
)

REF = "#/components/schemas/"
NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
SCHEMA = {"type": "object", "description": "A JSON Schema (Draft 2020-12); `$ref`s must "
                                           "resolve inside it."}
CALL_ID = {"type": "string", "minLength": 1, "maxLength": MAX_TOOL_CALL_ID_CHARS}


def _obj(props: dict, required=(), desc: str | None = None) -> dict:
    schema: dict = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(required)
    if desc:
        schema["description"] = desc
    return schema


STRUCTURED_DESCRIPTION = (
    "vLLM's structured outputs: exactly one of json (a schema, or its JSON text), regex, "
    "choice or grammar (EBNF / Lark), or json_object. vLLM's older top-level guided_json, "
    "guided_regex, guided_choice and guided_grammar are read the same way. At most one of "
    "response_format (other than text), structured_outputs and guided_* may be sent; with "
    "tools, only when tool_choice is \"none\".")
TOOLS_DESCRIPTION = (
    "Function tools. tool_choice \"auto\" (the default) lets the model answer or call; "
    "\"required\" or a named function constrain the output to the call(s). A template "
    "without tool syntax is given the tools in a system message and asked for "
    "`<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>` blocks.")


def request_fields() -> dict:
    """The structured-output fields both endpoints take."""
    return {
        "response_format": {"oneOf": [
            _obj({"type": {"const": "text"}}, ("type",)),
            _obj({"type": {"const": "json_object"}}, ("type",), "Any JSON object."),
            _obj({"type": {"const": "json_schema"},
                  "json_schema": _obj({"name": NAME, "description": {"type": "string"},
                                       "schema": SCHEMA, "strict": {"type": "boolean"}},
                                      ("name",))}, ("type", "json_schema")),
            {"type": "null"}]},
        "structured_outputs": {"type": ["object", "null"], "description": STRUCTURED_DESCRIPTION,
                               "properties": {
            "json": {"oneOf": [SCHEMA, {"type": "string"}]},
            "regex": {"type": "string", "minLength": 1, "maxLength": MAX_REGEX_CHARS},
            "choice": {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                       "items": {"type": "string", "minLength": 1,
                                 "maxLength": MAX_CHOICE_CHARS}},
            "grammar": {"type": "string", "minLength": 1},
            "json_object": {"type": "boolean"}}},
    }


def chat_fields() -> dict:
    """The tool fields of a chat request."""
    return {
        "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": {"$ref": REF + "Tool"},
                  "description": TOOLS_DESCRIPTION},
        "tool_choice": {"oneOf": [
            {"enum": list(TOOL_CHOICES)},
            _obj({"type": {"const": "function"}, "function": _obj({"name": NAME}, ("name",))},
                 ("type", "function"), "Call this function (it must be among tools)."),
            {"type": "null"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"], "default": True,
                                "description": "With tool_choice required: 1 or more calls."},
    }


def message_fields() -> dict:
    """The fields a chat message may carry besides role and content."""
    return {"tool_calls": {"type": "array", "maxItems": MAX_MESSAGE_TOOL_CALLS,
                           "items": {"$ref": REF + "ToolCall"},
                           "description": "assistant only: the calls it made"},
            "tool_call_id": {**CALL_ID, "description": "tool only (required): the call "
                                                       "this message answers"},
            "name": {"type": "string"}}


def schemas() -> dict:
    function = _obj({"name": NAME, "arguments": {
        "type": "string", "description": "The arguments object as JSON text."}},
        ("name", "arguments"))
    return {
        "Tool": _obj({"type": {"const": "function"}, "function": _obj({
            "name": NAME,
            "description": {"type": "string", "maxLength": MAX_TOOL_DESCRIPTION_CHARS},
            "parameters": {**SCHEMA, "description": "A JSON Schema of type object; omitted "
                                                    "or {}: no arguments."},
            "strict": {"type": "boolean"}}, ("name",))}, ("type", "function")),
        "ToolCall": _obj({"id": CALL_ID, "type": {"const": "function"}, "function": function},
                         ("id", "type", "function")),
        "ToolCallDelta": _obj({
            "index": {"type": "integer"}, "id": {"type": "string"},
            "type": {"const": "function"},
            "function": _obj({"name": {"type": "string"}, "arguments": {"type": "string"}})},
            ("index",), "The first delta of a call has id, type and name; later ones add "
                        "pieces of arguments."),
    }
