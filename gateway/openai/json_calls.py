"""The `delta.tool_calls` entries of a stream, and `CallStream`: the reader of a constrained
call (tool_choice "required" or a named function; gateway/openai/tool_stream.py has the rest).

The output is JSON: a call {"name": ..., "arguments": {...}} or an array of calls. Each call's
first entry carries index, id, type and name with arguments "", then its arguments follow as
they are written: the raw text of the arguments value with the whitespace between tokens
dropped, so the pieces joined are exactly the compact arguments JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from gateway.openai.schema.answers import ToolCallDelta
from gateway.openai.tools import new_call_id

_WS = " \t\n\r"
_LITERAL = frozenset("-+.0123456789eEtrufalsn")  # the characters of numbers, true, false, null


@dataclass
class Parsed:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # delta.tool_calls, in order

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


def header_entry(index: int, call_id: str, name: str) -> ToolCallDelta:
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}


def arguments_entry(index: int, text: str) -> ToolCallDelta:
    return {"index": index, "function": {"arguments": text}}


class _Frame:
    """An open object ("{") or array ("[") of the JSON being read."""

    __slots__ = ("kind", "expect", "key", "count", "call")

    def __init__(self, kind: str, call: _Call | None = None):
        self.kind = kind
        self.expect = "key" if kind == "{" else "value"  # "key", "colon", "value" or "comma"
        self.key: str | None = None  # the member being read (objects)
        self.count = 0  # members or items so far
        self.call = call  # set when this object is a call


class _Call:
    __slots__ = ("index", "name", "pending")

    def __init__(self):
        self.index: int | None = None  # its place among the calls sent, once its name is known
        self.name: str | None = None
        self.pending: list[str] = []  # arguments text not yet sent


class CallStream:
    """Reads a call object, or an array of them, character by character (a small JSON state
    machine: the answer is the same however the text is split). Text that is not such JSON
    (an engine that did not constrain the output) becomes content from where it stops being
    calls: all of it when no call had started."""

    def __init__(self, new_id=new_call_id):
        self.new_id = new_id
        self.stack: list[_Frame] = []
        self.calls: list[_Call] = []
        self.num_calls = 0  # calls started (their first entry sent)
        self.seen: list[str] = []  # the text so far, while no call has started
        self.string: list[str] | None = None  # the string being read, raw
        self.role = "value"  # that string is a "key", a call's "name" or another "value"
        self.escape = self.scalar = self.started = self.failed = False
        self.capture: _Call | None = None  # the call whose arguments are being read
        self.capture_depth = 0
        self.out = Parsed()

    def feed(self, text: str) -> Parsed:
        self.out = Parsed()
        if self.failed:
            self.out.content = text
            return self.out
        if not self.num_calls:
            self.seen.append(text)
        for pos, c in enumerate(text):
            if not self._step(c):
                self._fail(text[pos:])
                return self.out
        self._flush()
        return self.out

    def finish(self) -> Parsed:
        self.out = Parsed()
        if not self.failed:
            self._flush()
            if not self.num_calls:
                self.out.content = "".join(self.seen)
        return self.out

    def _fail(self, rest: str) -> None:
        self.failed = True
        if self.num_calls:
            self._flush()
            self.out.content = rest
        else:
            self.out.content = "".join(self.seen)

    def _step(self, c: str) -> bool:
        if self.string is not None:
            call = self.capture  # the closing quote of a string argument ends its capture
            if not self._in_string(c):
                return False
            self._keep(call, c)
            return True
        if self.scalar:
            if c in _LITERAL:
                self._keep(self.capture, c)
                return True
            self.scalar = False
            self._value_done()
        if c in _WS:
            return True
        call = self.capture  # the closing bracket of the arguments ends their capture
        if not self._structural(c):
            return False
        self._keep(call or self.capture, c)
        return True

    def _in_string(self, c: str) -> bool:
        assert self.string is not None
        if self.escape:
            self.escape = False
        elif c == "\\":
            self.escape = True
        elif c == '"':
            return self._close_string("".join(self.string))
        if self.role != "value":  # only keys and names are needed whole
            self.string.append(c)
        return True

    def _close_string(self, raw: str) -> bool:
        self.string = None
        if self.role == "value":
            self._value_done()
            return True
        try:
            text = orjson.loads(f'"{raw}"')
        except orjson.JSONDecodeError:
            return False
        top = self.stack[-1]
        if self.role == "key":
            top.key, top.expect = text, "colon"
            return True
        if top.call is not None and top.call.name is None:
            self._start(top.call, text)
        self._value_done()
        return True

    def _structural(self, c: str) -> bool:
        top = self.stack[-1] if self.stack else None
        if c == '"':
            if top is not None and top.kind == "{" and top.expect == "key":
                self.string, self.role = [], "key"
                return True
            if not self._begin_value(c):
                return False
            is_name = top is not None and top.call is not None and top.key == "name"
            self.string, self.role = [], "name" if is_name else "value"
            return True
        if c in "{[":
            if not self._begin_value(c):
                return False
            is_call = c == "{" and (top is None or (len(self.stack) == 1 and top.kind == "["))
            frame = _Frame(c, _Call() if is_call else None)
            if frame.call is not None:
                self.calls.append(frame.call)
            self.stack.append(frame)
            return True
        if c in "}]":
            empty = "key" if c == "}" else "value"
            if top is None or top.kind != ("{" if c == "}" else "[") or not (
                    top.expect == "comma" or (top.expect == empty and top.count == 0)):
                return False
            self.stack.pop()
            self._value_done()
            return True
        if c == ":" and top is not None and top.expect == "colon":
            top.expect = "value"
            return True
        if c == "," and top is not None and top.expect == "comma":
            top.expect = "key" if top.kind == "{" else "value"
            return True
        if c in _LITERAL and self._begin_value(c):
            self.scalar = True
            return True
        return False

    def _begin_value(self, c: str) -> bool:
        if not self.stack:  # the answer itself: a call or an array of calls, once
            if self.started or c not in "{[":
                return False
            self.started = True
            return True
        top = self.stack[-1]
        if top.expect != "value":
            return False
        top.expect, top.count = "comma", top.count + 1
        if top.call is not None and top.key == "arguments" and self.capture is None:
            self.capture, self.capture_depth = top.call, len(self.stack)
        return True

    def _value_done(self) -> None:
        if self.capture is not None and len(self.stack) == self.capture_depth:
            self.capture = None

    def _keep(self, call: _Call | None, c: str) -> None:
        if call is not None:
            call.pending.append(c)

    def _start(self, call: _Call, name: str) -> None:
        self._flush()  # earlier calls' arguments go out before this call begins
        call.name, call.index = name, self.num_calls
        self.num_calls += 1
        self.seen = []
        self.out.tool_calls.append(header_entry(call.index, self.new_id(), name))

    def _flush(self) -> None:
        for call in self.calls:
            if call.index is not None and call.pending:
                self.out.tool_calls.append(arguments_entry(call.index, "".join(call.pending)))
                call.pending.clear()
