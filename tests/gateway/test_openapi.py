"""The OpenAPI document: serialisable, complete, every $ref points at a defined schema, valid
against the OpenAPI 3.1 schema, and its ranges are the validators' own constants."""
from __future__ import annotations

import orjson
from openapi_spec_validator import OpenAPIV31SpecValidator

from contract.sampling_params import MAX_SEED, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, MIN_SEED
from gateway.http.openapi import build_openapi
from gateway.openai.requests import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_N
from gateway.openai.tools import MAX_TOOLS


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _doc(names=("smol",)) -> dict:
    return orjson.loads(orjson.dumps(build_openapi(names)))


def test_document_covers_every_route_and_resolves_refs():
    doc = _doc("smol")
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
    assert "cached_tokens" in schemas[usage["prompt_tokens_details"]["$ref"].rsplit("/")[-1]][
        "properties"]
    assert '"type": "cancel"' in doc["paths"]["/v1/ws"]["get"]["description"]


def test_document_is_valid_openapi_3_1():
    OpenAPIV31SpecValidator(_doc(("smol", "alias"))).validate()


def test_ranges_are_the_validators_constants():
    schemas = _doc()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert (chat["messages"]["minItems"], chat["messages"]["maxItems"]) == (1, MAX_MESSAGES)
    assert (chat["seed"]["minimum"], chat["seed"]["maximum"]) == (MIN_SEED, MAX_SEED)
    assert chat["top_logprobs"]["maximum"] == MAX_TOP_LOGPROBS
    assert chat["tools"]["maxItems"] == MAX_TOOLS
    assert [s.get("maxItems") for s in chat["stop"]["oneOf"]] == [None, MAX_STOP_STRINGS, None]
    parts = [s for s in schemas["TextMessage"]["properties"]["content"]["oneOf"]
             if s["type"] == "array"]
    assert parts[0]["maxItems"] == MAX_CONTENT_PARTS


def test_refused_fields_are_not_offered_and_model_names_are():
    schemas = _doc(("smol", "alias"))["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert not {"functions", "logit_bias", "suffix", "best_of"} & set(chat)
    assert chat["model"]["enum"] == ["smol", "alias", None]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
