"""The base of every request model, the typed unions JSON needs, and pydantic's validation
errors turned into the OpenAI error body the gateway has always sent.

Why strict: JSON has one number type but Python decodes `true` as a bool, which is also an int;
strict fields refuse a bool where a number is asked for (so `"n": true` never means n=1), and
a string where a number is. Absent and `null` are alike (OpenAI's API treats them so): every
optional field is `X | None = None`. Unknown fields are ignored, as they always were; the few
whose silent omission would change the answer are declared and refused by the models.

Unions of JSON kinds (a string or an array, ...) are tagged by the value's own JSON kind and
objects by a key ("role", "type"), so exactly one member is tried: the error names the field
the client got wrong, and the OpenAPI document gets a `oneOf` of disjoint members. Tags start
with "~" and are dropped from the `param`.

A list's cap (`max_length`) is checked by pydantic-core before any item is validated (the
input's length is known), so an oversized array costs no per-item work.
"""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, ValidationError
from pydantic_core import PydanticCustomError

from gateway.errors import APIError, bad_request

M = TypeVar("M", bound="Body")
# the error types whose place is a list item itself that the param keeps ("messages[0] must
# be an object"); a scalar item's error names the whole list ("stop must be ..."), as before
_ITEM_ERRORS = frozenset({"model_type", "dict_type", "model_attributes_type", "keyed"})
_KINDS = {str: "string", list: "array", dict: "object", bool: "boolean", int: "integer",
          float: "number", type(None): "null"}


class Body(BaseModel):
    """A JSON object of the API: strict, unknown keys ignored, no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=False)


def read(model: type[M], body: Any, context: dict | None = None) -> M:
    """`body` validated into `model`, or the 400 naming the first thing wrong; `context`
    carries caps known only at run time (the served context) to the model's validators."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise api_error(exc) from None


def refuse(why: str) -> PydanticCustomError:
    """A validator's error about the value where it stands: the param is its place."""
    return PydanticCustomError("refused", "{why}", {"why": why})


def too_long(max_length: int, actual_length: int) -> PydanticCustomError:
    """A list over a cap known only at run time, refused as a declared cap is (before its
    items are looked at, with code array_too_long)."""
    return PydanticCustomError("too_long", "allows at most {max_length} items",
                               {"max_length": max_length, "actual_length": actual_length})


def json_kind(value: Any) -> str:
    return "~" + _KINDS.get(type(value), "other")


def by_kind(why: str) -> Discriminator:
    """Tags a union by the value's JSON kind: `Annotated[Union[Annotated[str,
    Tag("~string")], Annotated[list[X], Tag("~array")]], by_kind("must be ...")]`; any other
    kind is refused with `why`."""
    return Discriminator(json_kind, custom_error_type="one_of", custom_error_message=why)


def by_key(key: str, tags: dict[str, str]) -> Discriminator:
    """Tags a union of objects by `key` (tags: the key's value -> member tag without "~"); an
    object without a known value is refused naming `key`, anything else as not an object."""
    def tag(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        found = value.get(key)
        return "~" + tags[found] if isinstance(found, str) and found in tags else None

    return Discriminator(tag, custom_error_type="keyed:" + key,
                         custom_error_message=f"must be one of {', '.join(tags)}")


# pydantic's errors as the gateway's

def api_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]  # fields are validated in declaration order
    kind, loc, value = error["type"], error["loc"], error.get("input")
    if kind.startswith("keyed:"):  # the type names the key (the context must be hashable)
        key, kind = kind[6:], "keyed"
        if isinstance(value, dict):  # an object with the key wrong or absent
            loc, value, kind = (*loc, key), value.get(key), "keyed_value"
    param = param_of(loc, kind)
    code = "array_too_long" if kind == "too_long" else None
    return bad_request(f"{param} {_why(kind, error, value)}", param, code=code)


def param_of(loc: tuple, kind: str) -> str:
    """('messages', 0, '~array', 1, 'type') -> "messages[0][1].type"; a scalar list item's
    index is dropped."""
    parts = [p for p in loc if not (isinstance(p, str) and p.startswith("~"))]
    if parts and isinstance(parts[-1], int) and kind not in _ITEM_ERRORS:
        parts = parts[:-1]
        while parts and isinstance(parts[-1], int):
            parts.pop()
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _type_name(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


_WANTS = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "bool_type": "a boolean", "string_type": "a string", "list_type": "an array",
          "model_type": "an object", "dict_type": "an object", "model_attributes_type":
          "an object"}


def _why(kind: str, error: Any, value: Any) -> str:
    ctx = error.get("ctx") or {}
    if kind in _WANTS:
        return f"must be {_WANTS[kind]}, got {_type_name(value)}"
    if kind == "missing":
        return "is required"
    if kind in ("one_of", "refused"):
        return ctx.get("why") or error["msg"]
    if kind == "keyed":
        return "must be an object"
    if kind == "keyed_value":
        return f"{error['msg']}, got {value!r:.40}"
    return _bound(kind, ctx, value) or error["msg"]


def _bound(kind: str, ctx: dict, value: Any) -> str | None:
    if kind == "too_long":
        return f"allows at most {ctx['max_length']} items, got {ctx['actual_length']}"
    if kind == "too_short":
        return "must be a non-empty array"
    if kind == "string_too_short":
        return "must be a non-empty string"
    if kind == "string_too_long":
        return f"must be a string of at most {ctx['max_length']} characters"
    if kind in ("greater_than_equal", "greater_than"):
        return f"must be at least {ctx.get('ge', ctx.get('gt'))}, got {value}"
    if kind in ("less_than_equal", "less_than"):
        return f"must be at most {ctx.get('le', ctx.get('lt'))}, got {value}"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {value!r:.40}"
    if kind == "string_pattern_mismatch":
        return "must be 1 to 64 letters, digits, _ or -"
    return None
