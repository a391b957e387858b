"""Function tools on the chat API: what the request's `tools`, `tool_choice` and
`parallel_tool_calls` mean once their shapes are valid (gateway/openai/schema/tools.py declares
and checks those), the checks across tools, and the `ToolSpec` they become.

What each tool_choice does:
- "none": the tools are not shown to the model; it answers in text.
- "auto" (the default with tools): the tools are shown through the chat template and the model
  chooses; its text is read for calls in its family's syntax (gateway/openai/tool_parsers/,
  chosen by --tool-call-parser or from the template), and always for the
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks the fallback asks for.
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
from gateway.openai.structured_api import MAX_SCHEMA_BYTES, schema_problem, walk

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


# the checks across tools

def tool_spec(functions: tuple[Function, ...], tool_choice: Any,
              parallel: bool) -> ToolSpec | None:
    """The checks across tools (distinct names, their schemas' total size, a tool_choice
    among them) over functions each already valid; None when no tools are given."""
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name {name!r} is already used by another "
                              "tool", f"tools[{i}].function.name")
    check_tools_total(sum(len(orjson.dumps(f.parameters)) for f in functions))
    choice, forced = _read_choice(tool_choice, names)
    if not functions:
        return None
    return ToolSpec(functions, choice, forced, parallel)


def check_tools_total(size: int) -> None:
    """A 400 naming tools when their parameters are `size` bytes of JSON, over the cap."""
    if size > MAX_TOOL_SCHEMA_BYTES:
        raise bad_request(f"the tools' parameters are {size} bytes of JSON; at most "
                          f"{MAX_TOOL_SCHEMA_BYTES} are allowed", "tools")


def check_raw_tools(tools: Any) -> None:
    """The size caps on a raw body's `tools`, read in one pass with no schema checked, so that
    a body over them is refused before its schemas cost anything (about 4 us a byte to check):
    one tool's parameters over a schema's cap (named as its own check names it), then the
    total. Not a list, or more than MAX_TOOLS: the declaration refuses it before any item."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        return
    total = 0
    for i, tool in enumerate(tools):
        size = _raw_parameters_size(tool)
        if size > MAX_SCHEMA_BYTES:
            where = f"tools[{i}].function.parameters"
            raise bad_request(f"{where} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} "
                              "are allowed", where)
        total += size
    check_tools_total(total)  # a lower bound of tool_spec's count: {} counts 2 bytes here


def _raw_parameters_size(tool: Any) -> int:
    function = tool.get("function") if isinstance(tool, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    if not isinstance(parameters, dict):
        return 0
    try:
        return len(orjson.dumps(parameters))
    except orjson.JSONEncodeError:  # nested past 255 levels: its own check refuses it
        return 0


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
    """(choice, forced name) of a tool_choice whose shape is already valid: only what needs
    the tools is checked here."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value == "required" and not names:
            raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
        return value, None
    name = value["function"]["name"]
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r:.80}, which is not among "
                          "tools", "tool_choice")
    return "function", name
