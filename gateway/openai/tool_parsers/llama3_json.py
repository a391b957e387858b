"""Llama 3.1, 3.2 and 3.3 (JSON tool calling, Meta's templates): the answer itself is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

possibly after <|python_tag|>, and several calls are separated by ";". A call region opens with
"{" as the answer's first non-space character, or with <|python_tag|> anywhere (text before it
is content, as SGLang reads it); it runs over the ";"-separated objects and ends after the
last one. "arguments" is read as well as "parameters". Text after the calls is content.

As vLLM's llama3_json parser streams it, a "{" after other text is content: a model answering
in prose that quotes JSON is not calling.
"""
from __future__ import annotations

from gateway.openai.tool_parsers.base import (
    Call,
    CallReader,
    Headed,
    Scanner,
    Separated,
    json_calls,
    json_object_head,
    json_objects,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonCalls(CallReader):
    OPENERS = (PYTHON_TAG,)
    START_OPENERS = ("{",)

    def _scanner(self, opener: str) -> Scanner:
        if opener == PYTHON_TAG:
            return Separated(len(opener), ";")
        return Headed(opener, json_object_head, Separated(0, ";"))

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        return json_calls(json_objects(region.removeprefix(PYTHON_TAG), ";"))
