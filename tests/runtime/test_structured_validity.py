"""Validity as a property, on the real model: every output sampled at temperature 1 under a
JSON schema validates with the `jsonschema` library, whatever the schema's shape."""
from __future__ import annotations

import json

import jsonschema
import pytest

from contract.sampling_params import SamplingParams, choice_seed
from tests.runtime.structured_helpers import assert_clean, run

SAMPLES = 5  # per schema, all in one batch with every other schema's
OBJECT = {"type": "object", "additionalProperties": False}
SCHEMAS = {
    "nested objects": {**OBJECT, "required": ["person"], "properties": {"person": {
        **OBJECT, "required": ["name", "address"], "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {**OBJECT, "required": ["city", "zip"], "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "arrays with bounds": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **OBJECT, "required": ["scores"], "properties": {"scores": {
            "type": "array", "minItems": 2, "maxItems": 4,
            "items": {"type": "integer", "minimum": 0, "maximum": 100}}}}},
    "enums": {**OBJECT, "required": ["color", "size", "level"], "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "level": {"enum": [1, 2, 3, None]}}},
    "numbers with ranges": {**OBJECT, "required": ["temp", "count", "ratio"], "properties": {
        "temp": {"type": "number", "minimum": -10.5, "maximum": 40},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
        "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}}},
    "strings with patterns": {**OBJECT, "required": ["code", "email"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}},
    "anyOf": {**OBJECT, "required": ["value", "note"], "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                            {"type": "string", "maxLength": 10}, {"type": "null"}]},
        "note": {"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["n/a"]}]}}},
}


@pytest.mark.model
def test_sampled_outputs_validate_for_every_schema(smollm_engine):
    engine, tok = smollm_engine, smollm_engine.tokenizer
    # one short prompt for all: the prefix cache computes it once; the grammar does the rest
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Give an example of a JSON value.")}]))
    jobs = {}
    for name, schema in SCHEMAS.items():
        for i in range(SAMPLES):
            params = SamplingParams(max_tokens=160, temperature=1.0, seed=choice_seed(5, i),
                                    structured={"type": "json", "schema": schema})
            jobs[f"{name}/{i}"] = (prompt, params)
    results, _ = run(engine, jobs)
    for rid, r in results.items():
        schema = SCHEMAS[rid.split("/")[0]]
        assert r.final.finish_reason == "stop", (rid, r.text)
        jsonschema.validate(json.loads(r.text), schema)
    assert len({r.text for r in results.values()}) > len(SCHEMAS)  # sampling varied them
    assert_clean(engine)
