"""Gemma 3. Gemma 3 has no tool tokens and its own template shows no tools; Google's guidance
is to describe the functions in the prompt and have the model write calls as Python. Neither
vLLM nor SGLang has a Gemma 3 parser: vLLM serves it with its `pythonic` parser and its
example template tool_chat_template_gemma3_pythonic.jinja, which asks for a Python list of
calls as the whole answer. This reader reads that, and Google's fenced form:

    [get_weather(city="Paris"), get_time(zone="CET")]
    ```tool_code
    get_weather(city="Paris")
    ```

A list opens a region only as the answer's first non-space character (as vLLM reads it); a
```tool_code fence anywhere, text around it being content. Inside the fence: calls, one per
line or as a list, or JSON objects {"name": ..., "arguments" (or "parameters"): ...}, the other
form Google's examples show; a JSON object as the whole answer is read too.

The calls are read with `ast.parse` (never run): keyword arguments only, their values literals
(strings, numbers, True/False/None and JSON's true/false/null, lists, tuples, dicts).

With Gemma 3's own template (no tool syntax) the gateway's fallback shows the tools and asks for
<tool_call> blocks, which this reader reads as every family's does (tool_parsers/base.py); a
Gemma template that shows the tools itself (vLLM's pythonic one) asks for the list.
"""
from __future__ import annotations

import ast
from typing import Any

from gateway.openai.tool_parsers.base import (
    Balanced,
    Call,
    CallReader,
    Headed,
    Scanner,
    Until,
    json_calls,
    json_object_head,
    json_objects,
    python_call_head,
)

TOOL_CODE, FENCE = "```tool_code", "```"
_NAMES = {"true": True, "false": False, "null": None, "none": None}


class Gemma3Calls(CallReader):
    OPENERS = (TOOL_CODE,)
    START_OPENERS = ("[", "{")

    def _scanner(self, opener: str) -> Scanner:
        if opener == TOOL_CODE:
            return Until(len(opener), FENCE)
        if opener == "[":
            return Headed(opener, python_call_head, Balanced(0, "[", "\"'"))
        return Headed(opener, json_object_head, Balanced(0, "{"))

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        if region.startswith(TOOL_CODE):
            code = region[len(TOOL_CODE):]
            code = (code[:-len(FENCE)] if closed else code).strip()
            if code.startswith("{"):
                return json_calls(json_objects(code, ";,"))
            return pythonic_calls(code)
        if region.startswith("{"):
            return json_calls(json_objects(region))
        return pythonic_calls(region)


def pythonic_calls(source: str) -> list[Call] | None:
    """`f(a=1)` lines, or a list of such calls; None when it is anything else."""
    try:
        tree = ast.parse(source.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    calls: list[Call] = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            return None
        value = statement.value
        for node in value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                    or node.args or any(k.arg is None for k in node.keywords):
                return None
            try:
                calls.append((node.func.id, {k.arg: _literal(k.value) for k in node.keywords}))
            except ValueError:
                return None
    return calls or None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id.lower() in _NAMES:
        return _NAMES[node.id.lower()]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(
            k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore
    raise ValueError("not a literal")
