"""The OpenAPI document: serialisable, complete, and every $ref points at a defined schema."""
from __future__ import annotations

import orjson

from gateway.http.openapi import build_openapi
from gateway.openai.requests import MAX_N


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_document_covers_every_route_and_resolves_refs():
    doc = orjson.loads(orjson.dumps(build_openapi("smol")))
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/v1/ws", "/health", "/ready", "/metrics", "/tokenize",
                                 "/detokenize", "/v1/responses", "/v1/responses/{response_id}"}
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "401", "402", "429", "503"}
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == MAX_N
    usage = schemas["Usage"]["properties"]
    assert "cached_tokens" in usage["prompt_tokens_details"]["properties"]
    assert '"type": "cancel"' in doc["paths"]["/v1/ws"]["get"]["description"]
