"""Property-based fuzzing of the generation endpoints from the served /openapi.json.

Bodies are drawn from the request schemas in the document (valid ones), then some are
mutated (a field replaced by a value of another type, or a made-up field added). Whatever
the body, the answer is a 200 with usage or a 4xx with an OpenAI error body: never a 5xx,
never a hang. Output budgets are capped so each example costs a few engine steps.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import auth
from tests.reliability.test_hostile_input import assert_openai_error

ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                        | st.text(max_size=20),
                        lambda kids: st.lists(kids, max_size=3)
                        | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=8)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """A strategy for values matching a (small subset of) JSON Schema, as /openapi.json uses."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["oneOf"]])
    kinds = schema.get("type", "object")
    if isinstance(kinds, list):
        return st.one_of([from_schema({**schema, "type": k}, defs, depth) for k in kinds])
    if kinds == "null":
        return st.none()
    if kinds == "boolean":
        return st.booleans()
    if kinds == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kinds == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False,
                         allow_infinity=False)
    if kinds == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=30)
    if kinds == "array":
        return st.lists(from_schema(schema.get("items", {}), defs, depth + 1),
                        min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k in required},
        optional={k: from_schema(v, defs, depth + 1) for k, v in props.items()
                  if k not in required})


def _cap(body: dict) -> dict:
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
            body[name] = max(1, min(body[name], 4))
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # else the budget is the rest of the context
    if body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4  # the Responses API's name (others ignore it)
    body.pop("priority", None)  # a tenant's class bounds it anyway; keep examples even
    return body


def mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw):
        body = _cap(draw(valid))
        action = draw(st.sampled_from(["keep", "retype", "extra"]))
        if action == "retype" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(ANY_JSON)
        elif action == "extra":
            body[draw(st.text(min_size=1, max_size=10))] = draw(ANY_JSON)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
        if body.get("max_output_tokens") is None:  # else the rest of the context: 40 s here
            body["max_output_tokens"] = 4
        return body
    return build()


def _schema_strategies(gw):
    doc = json.loads(gw.get("/openapi.json")[1])
    defs = doc["components"]["schemas"]
    return {path: mutated(from_schema(defs[name], defs)) for path, name in
            (("/v1/chat/completions", "ChatCompletionRequest"),
             ("/v1/completions", "CompletionRequest"), ("/v1/responses", "ResponsesRequest"),
             ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"))}


def check_success(path: str, body: dict, raw: bytes) -> None:
    """What a 200 must hold on each endpoint."""
    if path in ("/tokenize", "/detokenize"):
        assert ("count" if path == "/tokenize" else "prompt") in json.loads(raw), raw[:300]
    elif body.get("stream") is True:
        last = b"data: [DONE]" if path != "/v1/responses" else b"response.completed"
        assert last in raw[-2000:] or b"response.incomplete" in raw[-2000:], raw[-200:]
    else:
        assert "usage" in json.loads(raw), raw[:300]


def test_openapi_fuzz_never_5xx(gw):
    strategies = _schema_strategies(gw)
    session: dict = {}

    async def send(path: str, body: dict):
        s = session.get("s")
        async with s.post(gw.url + path, json=body, headers=auth("sk-alpha"),
                          timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.read()

    loop = asyncio.new_event_loop()
    session["s"] = loop.run_until_complete(_new_session())
    seen = {"ok": 0, "4xx": 0}

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(strategies)).flatmap(
        lambda p: st.tuples(st.just(p), strategies[p])))
    def check(case):
        path, body = case
        status, raw = loop.run_until_complete(send(path, body))
        assert status < 500, (body, raw[:300])
        if status == 200:
            seen["ok"] += 1
            check_success(path, body, raw)
        else:
            seen["4xx"] += 1
            assert_openai_error(status, raw)

    try:
        check()
    finally:
        loop.run_until_complete(session["s"].close())
        loop.close()
    assert seen["ok"] > 10 and seen["4xx"] > 10, seen  # both sides of the contract exercised


async def _new_session():
    return aiohttp.ClientSession()
