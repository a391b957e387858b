"""Typed reads of fields from a decoded JSON object; every wrong value is a 400 naming its param.

JSON has one number type but Python decodes `true` as a bool, which is also an int: every reader
here rejects bools where a number is asked for, so `"n": true` never silently means n=1.
A field that is absent or `null` yields the default, as OpenAI's API treats them alike.
"""
from __future__ import annotations

import math
from typing import Any

from gateway.errors import bad_request


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _wrong(param: str, want: str, value: Any):
    return bad_request(f"{param} must be {want}, got {_type_name(value)}", param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_int(body: dict, name: str, default: int | None, lo: int | None = None,
             hi: int | None = None, param: str | None = None) -> int | None:
    param = param or name
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise _wrong(param, "an integer", value)
    _check_range(param, value, lo, hi)
    return value


def read_number(body: dict, name: str, default: float | None, lo: float | None = None,
                hi: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if not (is_int(value) or isinstance(value, float)):
        raise _wrong(name, "a finite number", value)
    try:
        number = float(value)  # an integer beyond float's range overflows here
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number", name)
    _check_range(name, number, lo, hi)
    return number


def read_bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(param or name, "a boolean", value)
    return value


def read_str(body: dict, name: str, default: str | None, param: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _wrong(param or name, "a string", value)
    return value


def read_object(body: dict, name: str) -> dict:
    """A nested object, or {} when absent."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _wrong(name, "an object", value)
    return value


def read_str_list(body: dict, name: str, max_len: int) -> tuple[str, ...]:
    """A string or an array of at most `max_len` strings (OpenAI's `stop`), as a tuple."""
    value = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return _capped_list(name, value, max_len, lambda s: isinstance(s, str),
                        "a string or an array of strings")


def read_int_list(body: dict, name: str, max_len: int) -> tuple[int, ...]:
    """An array of at most `max_len` integers, as a tuple."""
    value = body.get(name)
    if value is None:
        return ()
    return _capped_list(name, value, max_len, is_int, "an array of integers")


def _capped_list(name: str, value: Any, max_len: int, item_ok, want: str) -> tuple:
    """The array's length is checked before its items are (its cap bounds the work)."""
    if not isinstance(value, list):
        raise _wrong(name, want, value)
    check_length(name, value, max_len)
    if not all(item_ok(v) for v in value):
        raise bad_request(f"{name} must be {want}", name)
    return tuple(value)


def check_length(param: str, value: list, max_len: int) -> None:
    """Every array a client sends has a cap, checked before anything looks at its items."""
    if len(value) > max_len:
        raise bad_request(f"{param} allows at most {max_len} items, got {len(value)}", param,
                          code="array_too_long")


def _check_range(param: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise bad_request(f"{param} must be at least {lo}, got {value}", param)
    if hi is not None and value > hi:
        raise bad_request(f"{param} must be at most {hi}, got {value}", param)
