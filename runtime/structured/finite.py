"""Schemas no finite JSON value satisfies, found before llguidance sees them.

`{"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}` describes
only infinitely nested objects. llguidance compiles it without complaint; its first mask then
computes the forced text `{"self": {"self": ...` until its per-step item limit stops it (67 ms
here, 150 ms on the reporting host, every request, on the step loop), and the request ends
mid-answer with an error. Here such a schema is refused at compile time instead: a least
fixpoint over the schema's nodes finds those with a finite instance (a scalar type, an empty
array, an object whose required properties all have one, an `anyOf` branch that has one...);
a root without one is refused.

Only a sure "no" refuses: whatever this does not model (an external `$ref`, an `$anchor`,
pattern properties) counts as satisfiable, and llguidance judges the rest.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_SCALARS = {"null", "boolean", "string", "number", "integer"}
MAX_ROUNDS = 256  # each round settles at least one node; deeper schemas are left to llguidance


_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def has_finite_instance(schema: Any) -> bool:
    """False only if no finite JSON value can match `schema` (a JSON Schema document)."""
    if not isinstance(schema, dict):
        return schema is not False
    nodes: dict[int, dict] = {}
    _collect(schema, nodes)
    state = _State(schema, set(nodes), set())
    for _ in range(MAX_ROUNDS):
        grown = {i for i, n in nodes.items() if i not in state.finite and state.node(n)}
        if not grown:
            return False
        state.finite |= grown
        if id(schema) in state.finite:
            return True
    return True  # too deep to settle here: not a sure "no"


def _collect(node: Any, out: dict[int, dict]) -> None:
    """Every subschema reached through schema keywords; the gateway caps nesting at 64."""
    if not isinstance(node, dict) or id(node) in out:
        return
    out[id(node)] = node
    for key, value in node.items():
        if key in _MAPS and isinstance(value, dict):
            for sub in value.values():
                _collect(sub, out)
        elif key in _LISTS and isinstance(value, list):
            for sub in value:
                _collect(sub, out)
        elif key in _ONE:
            _collect(value, out)


class _State:
    def __init__(self, root: dict, known: set[int], finite: set[int]):
        self.root, self.known, self.finite = root, known, finite

    def ok(self, sub: Any) -> bool:
        """Does this subschema have a finite instance, as far as known so far? One this
        walk does not reach (a `$ref` into an odd place) is not judged: yes."""
        if isinstance(sub, bool):
            return sub
        if not isinstance(sub, dict) or id(sub) not in self.known:
            return True
        return id(sub) in self.finite

    def node(self, node: dict) -> bool:
        ref = node.get("$ref")
        if isinstance(ref, str) and not self.ok(_resolve(self.root, ref)):
            return False
        if not all(self.ok(s) for s in _list(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            branches = _list(node, key)
            if branches and not any(self.ok(s) for s in branches):
                return False
        if "enum" in node or "const" in node:
            return True
        return any(self.of_type(node, t) for t in _types(node))

    def of_type(self, node: dict, kind: str) -> bool:
        if kind in _SCALARS:
            return True  # bounds that contradict each other are llguidance's to refuse
        if kind == "array":
            need = node.get("minItems", 0)
            if not isinstance(need, int) or need <= 0:
                return True
            prefix = _list(node, "prefixItems")
            items = node.get("items", True)
            return all(self.ok(prefix[i] if i < len(prefix) else items)
                       for i in range(min(need, len(prefix) + 1)))
        if kind == "object":
            return all(self.ok(_property(node, name))
                       for name in _list(node, "required") if isinstance(name, str))
        return True  # a type name JSON Schema does not have: llguidance says what is wrong


def _types(node: dict) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return _SCALARS | {"array", "object"}


def _property(node: dict, name: str) -> Any:
    props = node.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    if node.get("patternProperties"):
        return True  # which pattern matches is not modelled here
    return node.get("additionalProperties", True)


def _list(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local JSON-pointer `$ref` ("#", "#/$defs/x") names, else None."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None  # another document or an anchor: not modelled
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
