"""Structured outputs on the API: the constraint spec the engine takes, the caps and names the
request fields share (`response_format`, vLLM's `structured_outputs` and its older `guided_*`,
declared and read in gateway/openai/schema/structured.py), and the JSON Schema checks.

The spec (runtime SamplingParams.structured) is plain JSON, one of:
  {"type": "json"}                          any JSON object (json_object)
  {"type": "json", "schema": {...}}         a value matching a JSON Schema
  {"type": "regex", "pattern": "..."}       text matching a regular expression
  {"type": "choice", "choices": [...]}      exactly one of the strings
  {"type": "grammar", "grammar": "..."}     text of an EBNF / Lark grammar
each with "param": the API param the engine names when it refuses the constraint (too large,
too slow to compile, a regex or grammar it cannot read), so that refusal is a 400 naming it too.

JSON schemas are checked here, before anything is queued (`check_schema`): the Draft 2020-12
meta-schema, keywords no token grammar can enforce, every `$ref` resolving inside the document,
and caps on size and nesting. Regex and grammar syntax are left to the engine: its dialects, not
Python's, decide what they mean.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import jsonschema
import orjson
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from gateway.errors import bad_request

MAX_SCHEMA_BYTES = 64 * 1024  # compact JSON; the meta-schema check costs about 10 us a byte
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays; deeper would only exhaust the checker's stack
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 1024
# keywords that need the whole value, or relations between its parts, to decide: no grammar
# over tokens can enforce them (the engines we use report them unimplemented), so they are
# refused rather than silently ignored
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "contains", "minContains", "maxContains", "propertyNames",
                        "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
                        "$dynamicAnchor", "$recursiveRef")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
# options of vLLM's structured_outputs that change only how, never whether, output is valid
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace",
                      "disable_additional_properties", "whitespace_pattern", "backend")

# where subschemas sit inside a schema: the walk follows only these, so a property that happens
# to be called "not" is a name, not a keyword
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")

_META = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)
_BASE_URI = "urn:inferstack:schema"
# clients resend the same schema with every request: its verdict is kept (by digest); bodies
# are validated on a small thread pool (gateway/http/request_body.py), hence the lock
_VERDICTS: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
_MAX_VERDICTS = 256
_VERDICTS_LOCK = threading.Lock()


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` unless `schema` is a JSON Schema (Draft 2020-12) the engine can
    enforce: an object, within the caps, meta-schema valid, no unsupported keyword, no `$ref`
    that resolves to nothing inside the document (nothing is ever fetched)."""
    why = schema_problem(schema)
    if why is not None:
        raise bad_request(f"{param} {why}", param)


def schema_problem(schema: Any) -> str | None:
    """What is wrong with `schema` (to follow its param in a message), or None."""
    if not isinstance(schema, dict):
        return "must be a JSON Schema object"
    try:
        raw = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # orjson writes at most 255 levels: far past our cap
        return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
    if len(raw) > MAX_SCHEMA_BYTES:  # the size first: it bounds the depth walk and the check
        return f"is {len(raw)} bytes of JSON; at most {MAX_SCHEMA_BYTES} are allowed"
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
    verdict = _cached_verdict(hashlib.sha256(raw).digest(), schema)
    if verdict is None:
        return None
    why, where = verdict
    return why + (f" (at {where})" if where else "")


def _cached_verdict(digest: bytes, schema: dict) -> tuple[str, str] | None:
    with _VERDICTS_LOCK:
        if digest in _VERDICTS:
            _VERDICTS.move_to_end(digest)
            return _VERDICTS[digest]
    verdict = _verdict(schema)  # outside the lock: two threads may both check a new schema
    with _VERDICTS_LOCK:
        _VERDICTS[digest] = verdict
        if len(_VERDICTS) > _MAX_VERDICTS:
            _VERDICTS.popitem(last=False)
    return verdict


def _verdict(schema: dict) -> tuple[str, str] | None:
    """None when the schema passes, else (what is wrong, a JSON pointer to where)."""
    if not _META.is_valid(schema):  # the details only when needed: they cost as much again
        error = jsonschema.exceptions.best_match(_META.iter_errors(schema))
        pointer = "".join(f"/{p}" for p in error.path) if error is not None else ""
        return f"is not a valid JSON Schema: {error.message:.200}", pointer or "/"
    try:
        root = Resource.from_contents(schema, default_specification=DRAFT202012)
        resolver = Registry().with_resource(_BASE_URI, root).crawl() \
            .resolver(_BASE_URI).in_subresource(root)
    except Exception as exc:  # noqa: BLE001 - referencing's own errors have no common base
        return f"cannot be read for references: {exc!s:.200}", "/"
    for pointer, sub, scope in walk(schema, resolver):
        for keyword in UNSUPPORTED_KEYWORDS:
            if keyword in sub:
                return f"uses {keyword}, which this server cannot enforce", pointer
        if sub.get("uniqueItems") is True:
            return "uses uniqueItems, which this server cannot enforce", pointer
        ref = sub.get("$ref")
        if isinstance(ref, str) and not _resolves(scope, ref):
            return f"has a dangling $ref {ref!r:.100}: it resolves to no schema here", pointer
    return None


def walk(schema: dict, resolver=None, pointer: str = "") -> Iterator[tuple[str, dict, Any]]:
    """Every subschema (objects only) with its JSON pointer and, when given a resolver, the
    resolver for its base URI (a subschema with its own `$id` starts a new base)."""
    stack = [(pointer, schema, resolver)]
    while stack:
        where, sub, scope = stack.pop()
        if scope is not None and "$id" in sub and where:
            scope = scope.in_subresource(Resource.from_contents(sub, DRAFT202012))
        yield where, sub, scope
        for key in _SCHEMA_MAPS:
            if isinstance(sub.get(key), dict):
                stack += [(f"{where}/{key}/{name}", s, scope) for name, s in sub[key].items()
                          if isinstance(s, dict)]
        for key in _SCHEMA_LISTS:
            if isinstance(sub.get(key), list):
                stack += [(f"{where}/{key}/{i}", s, scope) for i, s in enumerate(sub[key])
                          if isinstance(s, dict)]
        for key in _SCHEMA_ONE:
            if isinstance(sub.get(key), dict):
                stack.append((f"{where}/{key}", sub[key], scope))


def _resolves(resolver, ref: str) -> bool:
    try:
        return isinstance(resolver.lookup(ref).contents, (dict, bool))
    except Unresolvable:
        return False


def _depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_SCHEMA_DEPTH:
                return level
            stack += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


__all__ = ["check_schema", "schema_problem", "walk", "MAX_SCHEMA_BYTES",
           "MAX_SCHEMA_DEPTH", "MAX_REGEX_CHARS", "MAX_GRAMMAR_BYTES", "MAX_CHOICES",
           "MAX_CHOICE_CHARS", "UNSUPPORTED_KEYWORDS", "GUIDED", "STRUCTURED_KINDS",
           "STRUCTURED_OPTIONS"]
