"""The reader every family's syntax shares: free text in which the model may write calls.

A family says where a call region opens (`OPENERS`, markers anywhere in the text, and
`START_OPENERS`, only before any other text), how far the region runs (`_scanner`: a small
incremental scanner over the pending text) and which calls the whole region holds (`_calls`).
Every family also reads <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks: a
template without tool syntax (DeepSeek-V3's and R1's own, Gemma 3's) gets the gateway's
fallback (contract/tool_template.py), which asks for them, while the model may still write its
family's own syntax. The rest is the same for every family, and the same as the Hermes reader
always did:

- text outside regions streams as content; a possible opener at the end of the text so far
  is held until the next piece decides it;
- a region is held until it ends, then becomes calls when every call in it names an offered
  tool and its arguments validate against the tool's parameters (regular expressions left
  out, `_regex_free`), else it is content exactly as written, markers and all;
- more calls than allowed (parallel_tool_calls false: one in the answer) is content too;
- a region still open when the answer ends (cut by max_tokens, or a model that never wrote
  its closing marker) is decided on what it holds;
- whitespace beside a call is not content: trailing whitespace is held until text follows,
  and dropped when a call comes next or the answer ends after one; an answer without calls
  keeps its text exactly.

Every decision depends only on the text, never on how it was split: a scanner answers "not
yet" (-1) exactly while more text could change its answer, so feeding the pieces of a stream
and feeding the whole answer at once give the same content and calls.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Protocol

import jsonschema
import orjson

from contract.tool_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.openai.json_calls import Parsed, arguments_entry, header_entry
from gateway.openai.structured_api import walk
from gateway.openai.tools import Function, ToolSpec, new_call_id

WS = " \t\n\r"
Call = tuple[str, Any]  # (name, arguments as written: an object, or a JSON text of one)


class Scanner(Protocol):
    def end(self, text: str) -> int:
        """Where the region that `text` begins with ends (the index just past it), or -1 while
        more text could still change that."""


class CallReader:
    OPENERS: tuple[str, ...] = ()
    START_OPENERS: tuple[str, ...] = ()

    def __init__(self, tools: ToolSpec, new_id=new_call_id):
        self.tools = tools
        self.openers = (*self.OPENERS, TOOL_CALL_OPEN)
        self.new_id = new_id
        self.pending = ""  # undecided text: a possible opener's start, or an open region
        self.scanner: Scanner | None = None  # the open region's
        self.at_start = True  # nothing but whitespace read so far
        self.held = ""  # trailing whitespace of the content
        self.after_call = False
        self.num_calls = 0
        self.validators: dict[str, jsonschema.protocols.Validator] = {}

    # the family's syntax

    def _scanner(self, opener: str) -> Scanner:
        raise NotImplementedError

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        """The calls a whole region holds, as written (not yet checked); None: not calls."""
        raise NotImplementedError

    # the reader

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.scanner is not None:
            self._region(self.pending, False, out)
        else:
            self._content(self.pending, out)
        self.pending, self.scanner = "", None
        if not self.num_calls:
            out.content += self.held
        self.held = ""
        return out

    def _step(self, out: Parsed) -> bool:
        """One decision about the pending text; False when it needs more text."""
        if self.scanner is not None:
            end = self.scanner.end(self.pending)
            if end < 0:
                return False
            region, self.pending = self.pending[:end], self.pending[end:]
            self.scanner = None
            self._region(region, True, out)
            return True
        if self.at_start and self.START_OPENERS:
            body = self.pending.lstrip(WS)
            lead = len(self.pending) - len(body)
            self._content(self.pending[:lead], out)  # whitespace: held, not sent
            self.pending = body
            if not body:
                return False
            for opener in self.START_OPENERS:
                if body.startswith(opener):
                    self._open(opener)
                    return True
            if any(opener.startswith(body) for opener in self.START_OPENERS):
                return False
        self.at_start = self.at_start and not self.pending.strip(WS)
        hit = min(((i, o) for o in self.openers if (i := self.pending.find(o)) >= 0),
                  default=None)
        if hit is None:
            cut = len(self.pending) - marker_prefix(self.pending, self.openers)
            self._content(self.pending[:cut], out)
            self.pending = self.pending[cut:]
            return False
        start, opener = hit
        self._content(self.pending[:start], out)
        self.pending = self.pending[start:]
        self._open(opener)
        return True

    def _open(self, opener: str) -> None:
        self.at_start = False
        self.scanner = Until(len(opener), TOOL_CALL_CLOSE) if opener == TOOL_CALL_OPEN \
            else self._scanner(opener)

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

    def _region(self, region: str, closed: bool, out: Parsed) -> None:
        try:
            calls = self._checked(tagged_call(region, closed) if region.startswith(
                TOOL_CALL_OPEN) else self._calls(region, closed))
        except (ValueError, TypeError, RecursionError):  # nested past any parser's depth
            calls = None
        if calls is None:
            self._content(region, out)
            return
        self.held, self.after_call = "", True
        for name, arguments in calls:
            out.tool_calls += [header_entry(self.num_calls, self.new_id(), name),
                               arguments_entry(self.num_calls, arguments)]
            self.num_calls += 1

    def _checked(self, calls: list[Call] | None) -> list[tuple[str, str]] | None:
        """(name, compact arguments JSON) of each call, when every one is a valid call of an
        offered tool and they are not more than allowed."""
        if not calls or (not self.tools.parallel and self.num_calls + len(calls) > 1):
            return None
        checked = []
        for name, arguments in calls:
            function = self.tools.function(name) if isinstance(name, str) else None
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = orjson.loads(arguments)
                except orjson.JSONDecodeError:
                    return None
            if function is None or not isinstance(arguments, dict):
                return None
            if not self._validator(function).is_valid(arguments):
                return None
            try:
                checked.append((function.name, orjson.dumps(arguments).decode()))
            except orjson.JSONEncodeError:  # a number too large for JSON, say
                return None
        return checked

    def _validator(self, function: Function):
        if function.name not in self.validators:
            self.validators[function.name] = jsonschema.Draft202012Validator(
                regex_free(function.parameters))
        return self.validators[function.name]


# pieces the families share

def tagged_call(region: str, closed: bool) -> list[Call] | None:
    """The call of a <tool_call> block (one the model never closed: as far as it goes)."""
    body = region[len(TOOL_CALL_OPEN):]
    if closed:
        body = body[:-len(TOOL_CALL_CLOSE)]
    try:
        call = json_call(orjson.loads(body.strip()))
    except orjson.JSONDecodeError:
        return None
    return None if call is None else [call]


def json_call(value: Any) -> Call | None:
    """A call written as a JSON object {"name": ..., "arguments" (or "parameters"): ...}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", value.get("parameters"))


def json_calls(values: list[Any] | None) -> list[Call] | None:
    """Every value a JSON call, or None."""
    calls = []
    for value in values or ():
        call = json_call(value)
        if call is None:
            return None
        calls.append(call)
    return calls or None


_DECODER = json.JSONDecoder()


def json_objects(text: str, separators: str = ";") -> list[Any] | None:
    """The JSON values of `text`, one after another, with whitespace or one of `separators`
    between them (and after the last); None when it is anything else."""
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in WS:
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        while pos < len(text) and text[pos] in WS:
            pos += 1
        if pos < len(text) and text[pos] in separators:
            pos += 1


class Until:
    """A region that runs to a closing marker, the marker included."""

    def __init__(self, start: int, closer: str):
        self.closer = closer
        self.searched = start

    def end(self, text: str) -> int:
        found = text.find(self.closer, self.searched)
        if found < 0:
            self.searched = max(self.searched, len(text) - len(self.closer) + 1)
            return -1
        return found + len(self.closer)


_CLOSING = {"{": "}", "[": "]", "(": ")"}


class Balanced:
    """One bracketed value (a JSON or Python literal) from its first non-space character to
    its matching closing bracket, strings skipped whole. It stops where the text stops being
    such a value (`closed` stays False)."""

    def __init__(self, start: int, opens: str = "{[", quotes: str = '"'):
        self.pos = start
        self.opens = opens
        self.quotes = quotes
        self.stack: list[str] = []
        self.quote: str | None = None
        self.escape = False
        self.closed = False

    def end(self, text: str) -> int:
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.quote is not None:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = None
            elif not self.stack:
                if c not in WS:
                    if c not in self.opens:
                        return self.pos - 1
                    self.stack.append(_CLOSING[c])
            elif c in self.quotes:
                self.quote = c
            elif c in _CLOSING:
                self.stack.append(_CLOSING[c])
            elif c in ")]}":
                if c != self.stack.pop():
                    return self.pos
                if not self.stack:
                    self.closed = True
                    return self.pos
        return -1


class Separated:
    """Bracketed values with `separator` between them: the region ends after the last value
    not followed (past whitespace) by the separator."""

    def __init__(self, start: int, separator: str = ";", opens: str = "{"):
        self.separator = separator
        self.opens = opens
        self.value = Balanced(start, opens)
        self.after: int | None = None  # where the last closed value ends

    def end(self, text: str) -> int:
        while True:
            if self.after is None:
                end = self.value.end(text)
                if end < 0 or not self.value.closed:
                    return end
                self.after = end
            pos = self.after
            while pos < len(text) and text[pos] in WS:
                pos += 1
            if pos == len(text):
                return -1
            if text[pos] != self.separator:
                return self.after
            self.value, self.after = Balanced(pos + 1, self.opens), None


class Headed:
    """`scanner`, once the text after the opener is seen to begin as a call can (`head`: True,
    False, or None while too little is there to tell). A region that cannot be a call ends
    right after its opener, as content, and the text after it streams on: an answer that
    merely begins with "{" or "[" is not held to its end."""

    def __init__(self, opener: str, head, scanner: Scanner):
        self.opener = opener
        self.head = head
        self.scanner = scanner
        self.ok = False

    def end(self, text: str) -> int:
        if not self.ok:
            verdict = self.head(text[len(self.opener):])
            if verdict is None:
                return -1
            if not verdict:
                return len(self.opener)
            self.ok = True
        return self.scanner.end(text)


def json_object_head(text: str) -> bool | None:
    """After a "{": a member's key comes (a quote past whitespace)."""
    rest = text.lstrip(WS)
    return None if not rest else rest[0] == '"'


def python_call_head(text: str) -> bool | None:
    """After a "[": a function's name and its "(" come."""
    rest = text.lstrip(WS)
    name = 0
    while name < len(rest) and (rest[name].isalnum() or rest[name] == "_"):
        name += 1
    if name == 0 or rest[0].isdigit():
        return None if not rest else False
    after = rest[name:].lstrip(WS)
    return None if not after else after[0] == "("


def regex_free(schema: dict) -> dict:
    """The schema without its regular expressions. Python's backtracking matcher on model text
    could stall the event loop on a hostile pattern; under tool_choice auto the arguments are
    checked against everything else (required and named calls have the grammar enforce all)."""
    schema = copy.deepcopy(schema)
    for _, sub, _ in walk(schema):
        sub.pop("pattern", None)
        sub.pop("patternProperties", None)
    return schema


def marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could begin one of `markers`."""
    longest = max((len(m) for m in markers), default=1)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0
