"""Bounds on what a schema-derived grammar lets a model write, so a constrained answer closes.

llguidance compiles `{"type": "number"}` to `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`:
a model that keeps preferring digits (greedy SmolLM2 on `population_millions` wrote
`312122223123444444444...`) never leaves the number and runs to max_tokens. Its JSON options
bound nothing there, so each schema is annotated with JSON Schema's own keywords, which
llguidance turns into bounded lexemes: |value| < 10^17 (`exclusiveMinimum`/`exclusiveMaximum`:
at most 17 integer digits, no exponent) and, for non-integers, `multipleOf` 10^-9 (at most 9
fraction digits; llguidance refuses trailing zeros past them too). A number longer than a
double holds is never useful, so this only removes answers nobody can read back exactly.

Values a schema leaves free (`{}`, `true`, absent `items` / `additionalProperties`, and the
whole of `json_object`) would get llguidance's unbounded "any"; they get a bounded "any"
instead (`$defs`, recursive). Whitespace is the server's: no free whitespace, whatever a
schema's `x-guidance` asks (JSON_OVERRIDES), so no run of it is unbounded either.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the stub's TypedDict of JSON options; not importable at run time
    from llguidance._lib import JsonCompileOptions

MAX_INT_DIGITS = 17  # a double's significant digits
MAX_FRACTION_DIGITS = 9
LIMIT = 10 ** MAX_INT_DIGITS
STEP = 10.0 ** -MAX_FRACTION_DIGITS  # llguidance reads it as exactly 1e-9 (coef 1, exp 9)
ANY_NAME = "inferstack_bounded_any"
ANY_REF = f"#/$defs/{ANY_NAME}"
_TYPES = ["null", "boolean", "string", "number", "array", "object"]
# the bounded "any": every type, numbers bounded, containers holding bounded "any" again
BOUNDED_ANY: dict = {"type": _TYPES, "exclusiveMinimum": -LIMIT, "exclusiveMaximum": LIMIT,
                     "multipleOf": STEP, "items": {"$ref": ANY_REF},
                     "additionalProperties": {"$ref": ANY_REF}}
# what the compiler's JSON options must say whatever a schema's "x-guidance" says: llguidance
# applies defaults, then x-guidance, then these; a pattern (even `\s*`) replaces the flag
JSON_OVERRIDES: JsonCompileOptions = {"whitespace_flexible": False, "whitespace_pattern": None}

_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUB_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if",
            "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
# keywords that say nothing about the value: a node of only these is a free value
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly"}
_FINITE = ("enum", "const")  # already a finite set of values


def bounded_schema(schema: dict) -> dict:
    """A copy of `schema` (never changed) whose numbers and free values are bounded."""
    out = _node(schema, free_ok=True, root=True)
    assert isinstance(out, dict)
    out.setdefault("$defs", {})
    if isinstance(out["$defs"], dict):
        out["$defs"] = {**out["$defs"], ANY_NAME: BOUNDED_ANY}
    return out


def _node(node: Any, free_ok: bool, root: bool = False) -> Any:
    """One subschema, bounded. `free_ok`: a free value here may become the bounded "any" (a
    `$ref`): not under `allOf` or beside a `$ref`, where llguidance would intersect two
    recursive schemas without end, nor under a nested `$id`, where "#" means another root."""
    if node is True:
        return {"$ref": ANY_REF} if free_ok else node
    if not isinstance(node, dict):
        return node
    if not root and "$id" in node:
        free_ok = False
    intersecting = "$ref" in node or "allOf" in node
    out = _children(node, free_ok and not intersecting)
    if not root and free_ok and set(node) <= _ANNOTATIONS:
        return {"$ref": ANY_REF}
    if any(k in node for k in _FINITE):
        return out
    types = _types(node)
    if types & {"number", "integer"}:
        _bound_numbers(out, integer_only=types <= {"integer"})
    if free_ok and not intersecting:
        _bound_containers(out, types)
    return out


def _children(node: dict, free_ok: bool) -> dict:
    out = dict(node)
    for key, value in node.items():
        if key in _SUB_MAPS and isinstance(value, dict):
            out[key] = {name: _node(sub, free_ok) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_node(sub, False) for sub in value]
        elif key in _SUB_LISTS and isinstance(value, list):
            out[key] = [_node(sub, free_ok) for sub in value]
        elif key in _SUB_ONE:
            out[key] = _node(value, free_ok)
    return out


def _types(node: dict) -> set[str]:
    """The types a node's own keywords allow (every type when it names none). A node that only
    combines others (`$ref`, `anyOf`, `oneOf`, `allOf`) leaves the bounds to them."""
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
        return set()
    return set(_TYPES) | {"integer"}


def _bound_numbers(out: dict, integer_only: bool) -> None:
    """Intersect the node's range with |value| < LIMIT and give non-integers a finest step.
    A schema's own wider bounds are clamped too (llguidance cannot even read one past 2^64)."""
    for key, clamp in (("minimum", max), ("exclusiveMinimum", max), ("maximum", min),
                       ("exclusiveMaximum", min)):
        edge = -LIMIT if clamp is max else LIMIT
        value = out.get(key)
        if _is_number(value):
            out[key] = clamp(value, edge)
        elif key.startswith("exclusive"):
            out[key] = edge
    if not integer_only and not _is_number(out.get("multipleOf")):
        out["multipleOf"] = STEP  # a schema's own step already bounds the fraction


def _bound_containers(out: dict, types: set[str]) -> None:
    """Free items and free extra properties become the bounded "any"."""
    if "array" in types and "items" not in out:  # after any prefixItems, as in 2020-12
        out["items"] = {"$ref": ANY_REF}
    if "object" in types and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = {"$ref": ANY_REF}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
