"""The OpenAPI component schemas, generated from the request models and answer TypedDicts.

Why a generator of our own: pydantic writes `anyOf` for unions and for `X | None`; OpenAPI
3.1 readers (and our fuzzer, tests/reliability/test_fuzz_openapi.py) read `oneOf` and
`"type": [X, "null"]` better, and our unions are disjoint by construction (tagged by JSON
kind or by key), so `oneOf` is exact. Field titles, which only repeat the names, are left out.
"""
from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, models_json_schema
from pydantic_core import core_schema

from gateway.openai.schema.answers import COMPONENTS
from gateway.openai.schema.chat import ChatCompletionRequest, CompletionRequest
from gateway.openai.schema.extensions import DetokenizeRequest, ResponsesRequest, TokenizeRequest

REF_TEMPLATE = "#/components/schemas/{model}"
REQUESTS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
            ResponsesRequest)


class OpenAPISchema(GenerateJsonSchema):
    """pydantic's generator, writing OpenAPI 3.1's idioms for unions and nulls."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def nullable_schema(self, schema: core_schema.NullableSchema) -> dict:
        inner = self.generate_inner(schema["schema"])
        kind = inner.get("type")
        if isinstance(kind, str) and "$ref" not in inner and "oneOf" not in inner:
            if "enum" in inner:
                return {**inner, "type": [kind, "null"], "enum": [*inner["enum"], None]}
            if "const" in inner:
                return {"enum": [inner["const"], None]}
            return {**inner, "type": [kind, "null"]}
        if "oneOf" in inner and len(inner) == 1:
            return {"oneOf": [*inner["oneOf"], {"type": "null"}]}
        return {"oneOf": [inner, {"type": "null"}]}

    def union_schema(self, schema: core_schema.UnionSchema) -> dict:
        members = super().union_schema(schema)
        if "anyOf" in members:
            members["oneOf"] = members.pop("anyOf")
        return members


def components() -> dict[str, dict]:
    """Every request and answer schema, keyed by its name, with `$ref`s between them."""
    answers = [(TypeAdapter(t), t.__name__) for t in COMPONENTS]
    defs: dict[str, dict] = {}
    _, requests = models_json_schema([(m, "validation") for m in REQUESTS],
                                     ref_template=REF_TEMPLATE, schema_generator=OpenAPISchema)
    defs.update(requests.get("$defs", {}))
    for adapter, name in answers:
        schema = adapter.json_schema(ref_template=REF_TEMPLATE, schema_generator=OpenAPISchema,
                                     mode="serialization")
        defs.update(schema.pop("$defs", {}))
        defs[name] = schema
    return defs


def with_model_names(schemas: dict[str, dict], names: tuple[str, ...]) -> dict[str, dict]:
    """The requests' `model` field as the served names (any other is 404 model_not_found)."""
    model = {"enum": [*names, None], "description": "A served name (any other is 404 "
                                                    "model_not_found); omitted: the first."}
    out = dict(schemas)
    for request in REQUESTS:
        schema = out[request.__name__]
        out[request.__name__] = {**schema, "properties": {**schema["properties"],
                                                          "model": model}}
    return out
