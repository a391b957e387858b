"""Mistral (7B Instruct v0.3, Nemo, Small, Large; mistral_common's tokenizers): calls follow
the [TOOL_CALLS] control token, in one of two forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

The first (tokenizers before v11) is a JSON array of calls (or one call object); the second
(v11 and later) is one call per [TOOL_CALLS], its name, then [ARGS] and the arguments object
(v13's [CALL_ID]id between them is read and its id dropped; a decoder that skipped the
special tokens leaves `get_weather{...}`, read too). Text before [TOOL_CALLS] is content, as
vLLM and SGLang read it.

Call ids are 9 letters and digits: Mistral's own chat templates refuse any other id when the
calls come back in the conversation (vLLM's mistral parser makes them so too).
"""
from __future__ import annotations

import random
import re
import string

import orjson

from gateway.openai.tool_parsers.base import WS, Balanced, Call, CallReader, json_call, json_calls

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MAX_NAME_CHARS = 256
_ID_CHARS = string.ascii_letters + string.digits
_NAMED = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*(\{.*\})\s*",
                    re.DOTALL)
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class _Scanner:
    """[TOOL_CALLS] then a JSON array or object, or NAME ([CALL_ID]ID) ([ARGS]) {...}."""

    def __init__(self, start: int):
        self.pos = start
        self.phase = "first"  # "first", "name", "id", "marker", then a Balanced body
        self.phase_was = ""  # the phase before "marker": an id follows the name only
        self.body: Balanced | None = None

    def end(self, text: str) -> int:
        while self.body is None:
            if self.pos == len(text):
                return -1
            c = text[self.pos]
            if self.phase == "first":
                if c in WS:
                    self.pos += 1
                elif c in "[{":
                    self.body = Balanced(self.pos, "[{")
                elif c in _NAME_CHARS:
                    self.phase = "name"
                else:
                    return self.pos
            elif self.phase in ("name", "id"):
                if c in _NAME_CHARS and (self.phase == "name" or c.isalnum()):
                    self.pos += 1
                    if self.pos - len(TOOL_CALLS) > MAX_NAME_CHARS:
                        return self.pos
                else:
                    self.phase_was, self.phase = self.phase, "marker"
            else:  # after the name or the id: [CALL_ID], [ARGS] or the arguments' "{"
                rest = text[self.pos:self.pos + len(CALL_ID)]
                if c == "{":
                    self.body = Balanced(self.pos, "{")
                elif rest.startswith(ARGS):
                    self.pos += len(ARGS)
                    self.body = Balanced(self.pos, "{")
                elif rest.startswith(CALL_ID) and self.phase_was == "name":
                    self.pos += len(CALL_ID)
                    self.phase = "id"
                elif ARGS.startswith(rest) or CALL_ID.startswith(rest):
                    return -1  # a marker's beginning: the next piece decides
                else:
                    return self.pos
        return self.body.end(text)


class MistralCalls(CallReader):
    OPENERS = (TOOL_CALLS,)

    def __init__(self, tools, new_id=mistral_call_id):
        super().__init__(tools, new_id)

    def _scanner(self, opener: str) -> _Scanner:
        return _Scanner(len(opener))

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        body = region[len(TOOL_CALLS):]
        if body.lstrip(WS)[:1] in ("[", "{"):
            try:
                value = orjson.loads(body.strip(WS))
            except orjson.JSONDecodeError:
                return None
            return json_calls(value if isinstance(value, list) else [value])
        named = _NAMED.fullmatch(body)
        if named is None:
            return None
        try:
            arguments = orjson.loads(named.group(2))
        except orjson.JSONDecodeError:
            return None
        call = json_call({"name": named.group(1), "arguments": arguments})
        return None if call is None else [call]
