"""A grammar that costs too much is refused, never a 200 with partial output and a bill: the
self-referential required schema is refused before any mask (its worker time, measured
in-process, stays within a small multiple of a plain schema's), a grammar that fails its
limits mid-output is refused the same way, and a ledger row of a failed request costs 0."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from contract.sampling_params import SamplingParams
from tests.runtime.structured_helpers import assert_clean, drain

SELF = {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}
# the same trap one level down, after a free string: only a whole-schema check can see it
DEEP = {"type": "object", "required": ["name", "next"], "$defs": {
    "loop": {"type": "object", "properties": {"again": {"$ref": "#/$defs/loop"}},
             "required": ["again"]}},
    "properties": {"name": {"type": "string"}, "next": {"$ref": "#/$defs/loop"}}}
PLAIN = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
# compiles and starts fine, then forces `xxxx...` without end after its first sampled letter
ENDLESS = 'start: /[a-z]/ rest\nrest: "x" rest'
MAX_RATIO = 3.0  # worker time of the refused schema against a plain one's (was about 40x)


def params(spec: dict) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0,
                          structured={**spec, "param": "response_format"})


def json_spec(schema: dict) -> dict:
    return {"type": "json", "schema": schema}


def worker_seconds(engine, rid: str, spec: dict) -> tuple[float, object]:
    """In-process mask and compile time one request costs the worker, and its result."""
    masks = engine.structured.masks.stats
    before = masks.seconds
    engine.add_request(rid, engine.tokenizer.encode("Describe yourself:"), params(spec))
    results, _ = drain(engine, [rid])
    job = engine.structured.compiler._cache[SamplingParams(
        structured=spec).structured_key]
    return masks.seconds - before + (job.seconds or 0.0), results[rid]


@pytest.mark.parametrize("schema", [SELF, DEEP], ids=["self", "deep"])
def test_an_unsatisfiable_schema_is_refused_before_any_mask(make_tiny_engine, schema):
    engine = make_tiny_engine()
    plain_s, plain = worker_seconds(engine, "plain", json_spec(PLAIN))
    bad_s, bad = worker_seconds(engine, "bad", json_spec(schema))
    assert plain.final.finish_reason in ("stop", "length")
    assert [o.finish_reason for o in bad.outputs] == ["rejected"] and bad.tokens == []
    assert bad.final.error["kind"] == "GrammarError"
    assert bad.final.error["param"] == "response_format"
    assert "no finite JSON value" in bad.final.error["message"]
    assert bad_s <= MAX_RATIO * plain_s, (bad_s, plain_s)
    assert_clean(engine)


def test_a_grammar_past_its_limits_mid_output_is_refused_not_finished(make_tiny_engine):
    engine = make_tiny_engine()
    spec = {"type": "grammar", "grammar": ENDLESS}
    start = time.perf_counter()
    _, result = worker_seconds(engine, "endless", spec)
    assert time.perf_counter() - start < 30  # a sanity bound only; the ratio test measures
    assert result.final.finish_reason == "rejected" and result.final.error is not None
    assert "limits" in result.final.error["message"]
    assert not any(o.finish_reason == "error" for o in result.outputs)
    assert_clean(engine)


def test_a_failed_requests_row_costs_nothing():
    """An error finish that reported usage (a worker's output) still settles at cost 0 with
    0 tokens, so the row's costs agree with its tokens and nobody pays for our failure."""
    from billing.budget import Reservation
    from billing.pricing import PriceBook
    from gateway.serving.accounting import Accounting, Charge

    rows = []
    budgets = SimpleNamespace(ledger=None, settle=lambda res, row: rows.append(row))
    limits = SimpleNamespace(refund=lambda *a: None, correct=lambda *a: None)
    table = SimpleNamespace(get=lambda rid: gen, move=lambda *a: None)
    accounting = Accounting(table, PriceBook.preset("seed"), budgets, limits)
    key = SimpleNamespace(tenant=SimpleNamespace(name="t"), name="k")
    gen = SimpleNamespace(
        request_id="r", charge=Charge(key, Reservation("t", "p", 1.0), 100, 1.0, 0.0, 1),
        first_token_at=None, finish_reasons={}, worker_timing=None, prompt_tokens=0,
        cached_tokens=0, completion_tokens=0, priority=0, enqueued_at=0.0,
        dispatched_at=None, settled_at=None, worker=None, trace_headers=None,
        choice_of=lambda rid: 0)
    accounting.on_output({"id": "r", "tokens": [1, 2], "finished": True, "reason": "error",
                          "usage": (10, 0, 2), "text": ""})
    assert len(rows) == 1 and rows[0].status == "error"
    assert rows[0].cost_total == 0 and rows[0].output_tokens == 0
    assert accounting.revenue.total == 0
