"""The shape of a request's `structured` spec, checked at admission (no grammar library here).

A spec is a JSON-able dict, one of:
    {"type": "json", "schema": {...}}     a JSON schema; without "schema": any JSON object
    {"type": "regex", "pattern": "..."}   the whole output matches the regular expression
    {"type": "choice", "choices": [...]}  the output is exactly one of the strings
    {"type": "grammar", "grammar": "..."} a context-free grammar in Lark or GBNF syntax
each with an optional "param": the API parameter it came from, named by every error about it.
"""
from __future__ import annotations

import json

from contract.errors import InvalidRequestError

MAX_SPEC_BYTES = 64 << 10  # larger specs are refused before any compile is tried
DEFAULT_PARAM = "structured"
# the field each kind requires, and its type
_BODY = {"json": ("schema", dict), "regex": ("pattern", str), "choice": ("choices", list),
         "grammar": ("grammar", str)}


def spec_param(spec: object) -> str:
    """The parameter an error about this spec names: its own "param", else "structured"."""
    if isinstance(spec, dict) and isinstance(spec.get("param"), str) and spec["param"]:
        return spec["param"]
    return DEFAULT_PARAM


def spec_key(spec: dict) -> str:
    """Canonical text of the grammar the spec describes: equal for equal grammars (key order
    and the "param" label do not matter), so compiled grammars are cached by it."""
    body = {k: v for k, v in spec.items() if k != "param"}
    if body == {"type": "json"}:
        body = {"type": "json", "schema": {"type": "object"}}  # OpenAI's json_object
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def validate_spec(spec: object) -> str:
    """Raise InvalidRequestError (naming the spec's param) unless `spec` is a well-formed spec
    within the size cap; return its canonical key."""
    param = spec_param(spec)

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(why, param=param)

    if not isinstance(spec, dict):
        raise bad(f"the structured-output spec must be an object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind not in _BODY:
        raise bad(f"the structured-output type must be one of {sorted(_BODY)}, got {kind!r:.40}")
    field, kind_type = _BODY[kind]
    allowed = {"type", "param", field}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise bad(f"unknown fields in the {kind} spec: {unknown[:5]}")
    if "param" in spec and not isinstance(spec["param"], str):
        raise bad("the spec's param must be a string")
    if field not in spec and kind != "json":
        raise bad(f"a {kind} spec needs {field!r}")
    value = spec.get(field)
    if field in spec and not isinstance(value, kind_type):
        raise bad(f"the {kind} spec's {field!r} must be a {_TYPE_NAMES[kind_type]}")
    _check_body(kind, value, bad)
    try:
        key = spec_key(spec)
    except (TypeError, ValueError) as exc:  # not JSON-able (a tuple key, a NaN is fine)
        raise bad(f"the {kind} spec is not JSON: {exc}") from None
    if len(key.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise bad(f"the {kind} spec is larger than {MAX_SPEC_BYTES} bytes")
    return key


_TYPE_NAMES = {dict: "JSON object", str: "string", list: "list"}


def _check_body(kind: str, value: object, bad) -> None:
    if kind in ("regex", "grammar") and not value:
        raise bad(f"the {kind} spec's text must not be empty")
    if kind == "choice":
        assert isinstance(value, list)
        if not value:
            raise bad("the choice spec needs at least one choice")
        if not all(isinstance(c, str) and c for c in value):
            raise bad("every choice must be a non-empty string")
