"""From the text a model writes to OpenAI's tool calls, piece by piece, for streams and whole
answers alike.

Two readers share one interface: `feed(text)` for each new piece of output and `finish()` at
its end, each returning the new content and the new `delta.tool_calls` entries (`Parsed`):
- `CallStream` (gateway/openai/json_calls.py), for tool_choice "required" or a named function:
  the output is constrained to the JSON of a call or an array of calls, whose arguments stream
  as they are written.
- `TaggedCalls`, for "auto": free text in which the model may write
  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (contract/tool_template.py). Text
  around the blocks streams as content; a block is held until it closes, then becomes a call
  when it names a tool and its arguments validate, else it is content as written.

A whole answer is the same reader fed everything at once (`collect`), its entries merged as the
openai SDK merges a stream's: a streamed answer rebuilds exactly the non-streamed one.
"""
from __future__ import annotations

import copy

import jsonschema
import orjson

from contract.tool_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.openai.json_calls import CallStream, Parsed, arguments_entry, header_entry
from gateway.openai.schema.answers import ToolCall, ToolCallDelta
from gateway.openai.structured_api import walk
from gateway.openai.tools import Function, ToolSpec, new_call_id


def reader_for(tools: ToolSpec | None, new_id=new_call_id):
    """The reader of one choice's output, or None when it is plain text."""
    if tools is None or tools.choice == "none":
        return None
    return CallStream(new_id) if tools.constrained else TaggedCalls(tools, new_id)


def collect(reader, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: (its content, None when empty; its tool calls)."""
    parsed = reader.feed(text)
    parsed.extend(reader.finish())
    return parsed.content or None, merge_calls(parsed.tool_calls)


def merge_calls(entries: list[ToolCallDelta]) -> list[ToolCall]:
    """`delta.tool_calls` entries merged by index into whole calls, as the SDK does."""
    calls: dict[int, ToolCall] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"id": None, "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
        function = entry.get("function", {})
        if "id" in entry:
            call["id"] = entry["id"]
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def finish_reason(reason: str | None, reader) -> str | None:
    """A choice that ended by itself after calling tools ends with "tool_calls"; one cut by
    max_tokens stays "length"."""
    if reader is not None and reader.num_calls and reason == "stop":
        return "tool_calls"
    return reason


# calls the model chose to write (tool_choice auto)

class TaggedCalls:
    """Content with <tool_call> blocks. Whitespace beside a call is not content: it is held
    back until text follows, and dropped when a call comes next or the answer ends after one;
    an answer without calls keeps its text exactly."""

    def __init__(self, tools: ToolSpec, new_id=new_call_id):
        self.tools = tools
        self.new_id = new_id
        self.pending = ""  # undecided text: a possible marker's start, or an open block
        self.searched = 0  # how much of an open block has been searched for its end
        self.in_call = False
        self.held = ""  # trailing whitespace of the content
        self.after_call = False
        self.num_calls = 0
        self.validators: dict[str, jsonschema.protocols.Validator] = {}

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while True:
            if self.in_call:
                end = self.pending.find(TOOL_CALL_CLOSE, self.searched)
                if end < 0:
                    self.searched = max(0, len(self.pending) - len(TOOL_CALL_CLOSE) + 1)
                    return out
                block, self.pending = self.pending[:end], self.pending[end + len(TOOL_CALL_CLOSE):]
                self.in_call, self.searched = False, 0
                self._block(block, True, out)
                continue
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                cut = len(self.pending) - _marker_prefix(self.pending)
                self._content(self.pending[:cut], out)
                self.pending = self.pending[cut:]
                return out
            self._content(self.pending[:start], out)
            self.pending = self.pending[start + len(TOOL_CALL_OPEN):]
            self.in_call = True

    def finish(self) -> Parsed:
        out = Parsed()
        if self.in_call:  # a block the model ended without its closing tag
            self._block(self.pending, False, out)
        else:
            self._content(self.pending, out)
        self.pending = ""
        if not self.num_calls:
            out.content += self.held
        self.held = ""
        return out

    def _content(self, text: str, out: Parsed) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        out.content += body

    def _block(self, block: str, closed: bool, out: Parsed) -> None:
        call = self._parse(block)
        if call is None or (self.num_calls and not self.tools.parallel):
            self._content(TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else ""), out)
            return
        self.held, self.after_call = "", True
        name, arguments = call
        out.tool_calls += [header_entry(self.num_calls, self.new_id(), name),
                           arguments_entry(self.num_calls, arguments)]
        self.num_calls += 1

    def _parse(self, block: str) -> tuple[str, str] | None:
        """(name, compact arguments JSON) when the block is a valid call of an offered tool."""
        try:
            value = orjson.loads(block.strip())
        except orjson.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        function = self.tools.function(value["name"])
        arguments = value.get("arguments", value.get("parameters"))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return None
        if function is None or not isinstance(arguments, dict):
            return None
        if not self._validator(function).is_valid(arguments):
            return None
        return function.name, orjson.dumps(arguments).decode()

    def _validator(self, function: Function):
        if function.name not in self.validators:
            self.validators[function.name] = jsonschema.Draft202012Validator(
                _regex_free(function.parameters))
        return self.validators[function.name]


def _regex_free(schema: dict) -> dict:
    """The schema without its regular expressions. Python's backtracking matcher on model text
    could stall the event loop on a hostile pattern; under tool_choice auto the arguments are
    checked against everything else (required and named calls have the grammar enforce all)."""
    schema = copy.deepcopy(schema)
    for _, sub, _ in walk(schema):
        sub.pop("pattern", None)
        sub.pop("patternProperties", None)
    return schema


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that could begin a <tool_call> marker."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
