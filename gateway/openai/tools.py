"""Function tools on the chat API: `tools`, `tool_choice`, `parallel_tool_calls` and the tool
fields of messages, validated into a `ToolSpec`.

What each tool_choice does:
- "none": the tools are not shown to the model; it answers in text.
- "auto" (the default with tools): the tools are shown through the chat template and the model
  chooses; its text is read for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks (gateway/openai/tool_stream.py).
- "required", or {"type": "function", "function": {"name": ...}}: the output is constrained to
  the JSON of the call(s) by a schema built here (`ToolSpec.constraint`): one object
  {"name": <const>, "arguments": <the tool's parameters>}, name first; with "required" and
  parallel_tool_calls, an array of 1 to MAX_PARALLEL_CALLS of them.
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import bad_request
from gateway.openai.json_fields import check_length, read_bool
from gateway.openai.structured_api import NAME_PATTERN, schema_problem, walk

MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 64 * 1024  # all tools' parameters together, as compact JSON
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_PARALLEL_CALLS = 16  # calls in one constrained answer with parallel_tool_calls
MAX_MESSAGE_TOOL_CALLS = 128  # calls one assistant message of the conversation may carry
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # a checked JSON Schema of type object
    strict: bool | None = None

    def as_tool(self) -> dict:
        """The OpenAI (and Hugging Face template) shape of this tool."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required" or "function" (a named one)
    forced: str | None = None  # the function's name, for choice "function"
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def offered(self) -> list[dict] | None:
        """The tools the prompt shows the model: none for "none", only the named one when a
        function is forced (the others could only mislead it)."""
        if self.choice == "none":
            return None
        return [f.as_tool() for f in self._used()]

    def function(self, name: str) -> Function | None:
        return next((f for f in self.functions if f.name == name), None)

    def constraint(self) -> dict | None:
        """The structured-output spec a required or named call is generated under."""
        if not self.constrained:
            return None
        used = self._used()
        calls = [_call_schema(f) for f in used]
        one: dict = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.choice == "required" and self.parallel:
            one = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        schema = {**one, "$defs": {_def_key(f): _rebased(f.parameters, _def_key(f))
                                   for f in used}}
        return {"type": "json", "schema": schema, "param": "tools"}

    def _used(self) -> tuple[Function, ...]:
        if self.choice == "function":
            return tuple(f for f in self.functions if f.name == self.forced)
        return self.functions


def _def_key(f: Function) -> str:
    return f"tool-{f.name}"


def _call_schema(f: Function) -> dict:
    # the parameters sit in the root's $defs, so their own $refs still resolve (rebased) and
    # every engine finds them: some cannot follow a pointer through an array index
    return {"type": "object",
            "properties": {"name": {"const": f.name},
                           "arguments": {"$ref": f"#/$defs/{_def_key(f)}"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebased(parameters: dict, key: str) -> dict:
    """A copy of `parameters` whose document-local $refs point to where it now lives."""
    moved = copy.deepcopy(parameters)
    moved.pop("$schema", None)  # only a document's root may name its dialect
    for _, sub, _ in walk(moved):
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            sub["$ref"] = f"#/$defs/{key}{ref[1:]}"
    return moved


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# the request's tools

def read_tools(body: dict) -> ToolSpec | None:
    """tools, tool_choice and parallel_tool_calls; None when no tools are given."""
    parallel = read_bool(body, "parallel_tool_calls", True)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be an array of function tools", "tools")
    check_length("tools", tools or [], MAX_TOOLS)
    functions = tuple(_read_tool(t, f"tools[{i}]") for i, t in enumerate(tools or []))
    return tool_spec(functions, body.get("tool_choice"), parallel)


def tool_spec(functions: tuple[Function, ...], tool_choice: Any,
              parallel: bool) -> ToolSpec | None:
    """The checks across tools (distinct names, their schemas' total size, a tool_choice
    among them) over functions each already valid; None when no tools are given."""
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name {name!r} is already used by another "
                              "tool", f"tools[{i}].function.name")
    size = sum(len(orjson.dumps(f.parameters)) for f in functions)
    if size > MAX_TOOL_SCHEMA_BYTES:
        raise bad_request(f"the tools' parameters are {size} bytes of JSON; at most "
                          f"{MAX_TOOL_SCHEMA_BYTES} are allowed", "tools")
    choice, forced = _read_choice(tool_choice, names)
    if not functions:
        return None
    return ToolSpec(functions, choice, forced, parallel)


def _read_tool(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", where)
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type must be \"function\", got {tool.get('type')!r:.40}",
                          f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object with a name", f"{where}.function")
    where = f"{where}.function"
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, _ or -",
                          f"{where}.name")
    description = function.get("description")
    if description is not None and (not isinstance(description, str)
                                    or len(description) > MAX_TOOL_DESCRIPTION_CHARS):
        raise bad_request(f"{where}.description must be a string of at most "
                          f"{MAX_TOOL_DESCRIPTION_CHARS} characters", f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    return Function(name, description, _read_parameters(function.get("parameters"), where),
                    strict)


def _read_parameters(parameters: Any, where: str) -> dict:
    param = f"{where}.parameters"
    if parameters is None or parameters == {}:  # OpenAI's meaning, and the usual spelling
        return NO_ARGUMENTS_SCHEMA()  # of "no arguments"
    why = parameters_problem(parameters)
    if why is not None:
        raise bad_request(f"{param} {why}", param)
    return parameters


def NO_ARGUMENTS_SCHEMA() -> dict:  # noqa: N802 - a fresh constant each time (callers own it)
    return {"type": "object", "properties": {}}


def parameters_problem(parameters: Any) -> str | None:
    """What is wrong with a tool's `parameters` (to follow its param), or None."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return "must be a JSON Schema of type object: arguments are always a JSON object"
    why = schema_problem(parameters)
    if why is not None:
        return why
    for pointer, sub, _ in walk(parameters):
        ref = sub.get("$ref")
        # a tool's schema is moved into a larger one: only references inside it can follow
        if "$id" in sub or (isinstance(ref, str) and not ref.startswith("#")):
            return (f"uses $id or a $ref outside itself (at {pointer or '/'}); only "
                    "references inside the schema ('#/...') are supported")
    return None


def _read_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a "
                              f"named function, got {value!r:.40}", "tool_choice")
        if value == "required" and not names:
            raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
        return value, None
    if not isinstance(value, dict):
        raise bad_request("tool_choice must be a string or a named function object",
                          "tool_choice")
    if value.get("type") != "function":
        raise bad_request("tool_choice.type must be \"function\", got "
                          f"{value.get('type')!r:.40}", "tool_choice.type")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name must be a string",
                          "tool_choice.function.name")
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r:.80}, which is not among "
                          "tools", "tool_choice")
    return "function", name


# the tool fields of conversation messages

def read_message_tool_calls(message: dict, where: str) -> tuple[dict, ...]:
    """An assistant message's earlier calls, as {"id", "type", "function": {"name",
    "arguments"}} (arguments kept as the JSON text the client sent)."""
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    where = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where)
    check_length(where, calls, MAX_MESSAGE_TOOL_CALLS)
    return tuple(_read_call(c, f"{where}[{j}]") for j, c in enumerate(calls))


def _read_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be an object", where)
    call_id = _read_id(call.get("id"), f"{where}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f"{where}.type must be \"function\"", f"{where}.type")
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, _ or -",
                          f"{where}.function.name")
    if not isinstance(arguments, str):
        raise bad_request(f"{where}.function.arguments must be a string of JSON",
                          f"{where}.function.arguments")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def read_tool_call_id(message: dict, where: str) -> str:
    """The call a tool message answers."""
    return _read_id(message.get("tool_call_id"), f"{where}.tool_call_id")


def _read_id(value: Any, param: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TOOL_CALL_ID_CHARS:
        raise bad_request(f"{param} must be a string of 1 to {MAX_TOOL_CALL_ID_CHARS} "
                          "characters", param)
    return value
