"""Shared by the structured-output tests: specs with an independent validity check each, and
running requests through an engine to completion."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"type": "string", "enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"}}}
SPECS = {
    "json": {"type": "json", "schema": SCHEMA, "param": "response_format"},
    "regex": {"type": "regex", "pattern": "[a-c]{3,6}-[0-9]{2}"},
    "choice": {"type": "choice", "choices": ["alpha", "beta gamma", "delta"]},
    "grammar": {"type": "grammar", "grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'},
}


def is_valid(spec: dict, text: str) -> bool:
    """Does `text` match the spec? Checked without the grammar library."""
    kind = spec["type"]
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), spec.get("schema", {"type": "object"}))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(spec["pattern"], text) is not None
    if kind == "choice":
        return text in spec["choices"]
    return re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text) is not None  # SPECS["grammar"]


@dataclass
class Result:
    tokens: list[int]
    text: str
    outputs: list  # every RequestOutput, in order

    @property
    def final(self):
        return self.outputs[-1]


def run(engine, jobs: dict) -> tuple[dict[str, Result], int]:
    """Add every (prompt, params) job under its id and step until all finish: the results by
    id, and the number of steps taken."""
    for rid, (prompt, params) in jobs.items():
        engine.add_request(rid, prompt, params)
    return drain(engine, list(jobs))


def drain(engine, request_ids: list[str]) -> tuple[dict[str, Result], int]:
    """Step until the already-added requests finish: their results by id, and the steps."""
    outs: dict[str, list] = {rid: [] for rid in request_ids}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            outs[out.request_id].append(out)
        steps += 1
    return {rid: Result([t for o in os for t in o.new_token_ids],
                        "".join(o.new_text for o in os), os)
            for rid, os in outs.items()}, steps


def assert_clean(engine) -> None:
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.structured.pending
