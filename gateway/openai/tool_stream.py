"""From the text a model writes to OpenAI's tool calls, piece by piece, for streams and whole
answers alike.

Two readers share one interface: `feed(text)` for each new piece of output and `finish()` at
its end, each returning the new content and the new `delta.tool_calls` entries (`Parsed`):
- `CallStream` (gateway/openai/json_calls.py), for tool_choice "required" or a named function:
  the output is constrained to the JSON of a call or an array of calls, whose arguments stream
  as they are written.
- for "auto", the reader of the model family's syntax (gateway/openai/tool_parsers/: hermes's
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, llama3_json, mistral, deepseek_v3,
  gemma3; --tool-call-parser, by default from the chat template): free text in which the model
  may write calls. Text around them streams as content; a call is held until it ends, then
  becomes a call when it names a tool and its arguments validate, else it is content as
  written.

A whole answer is the same reader fed everything at once (`collect`), its entries merged as the
openai SDK merges a stream's: a streamed answer rebuilds exactly the non-streamed one.
"""
from __future__ import annotations

from gateway.openai.json_calls import CallStream
from gateway.openai.schema.answers import ToolCall, ToolCallDelta
from gateway.openai.tool_parsers import reader_class
from gateway.openai.tool_parsers.hermes import HermesCalls
from gateway.openai.tools import ToolSpec, new_call_id

TaggedCalls = HermesCalls  # the <tool_call> reader, by its earlier name


def reader_for(tools: ToolSpec | None, new_id=None, *, parser: str = "auto"):
    """The reader of one choice's output, or None when it is plain text. `parser`: the family
    whose syntax "auto" reads (gateway/openai/tool_parsers/; `auto` not resolved: hermes).
    `new_id` makes call ids (by default call_ and 24 hex digits; Mistral's 9 alphanumerics)."""
    if tools is None or tools.choice == "none":
        return None
    if tools.constrained:
        return CallStream(new_id or new_call_id)
    reader = reader_class(parser)
    return reader(tools) if new_id is None else reader(tools, new_id)


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
