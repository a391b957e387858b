"""Schema-derived grammars close: numbers and whitespace are bounded by the grammar itself, so a
model that prefers digits or whitespace forever still ends its answer within a few dozen
tokens; `jump_forward: false` appends no forced token."""
from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from contract.sampling_params import SamplingParams
from runtime.structured.bounds import MAX_FRACTION_DIGITS, MAX_INT_DIGITS
from runtime.structured.compiler import compile_grammar
from tests.runtime.structured_helpers import assert_clean, is_valid, run

NUMBER = {"type": "object", "additionalProperties": False,
          "required": ["population_millions"],
          "properties": {"population_millions": {"type": "number"}}}
LOOSE = {**NUMBER, "x-guidance": {"whitespace_flexible": True}}
PATTERN = {**NUMBER, "x-guidance": {"whitespace_pattern": r"[\x20\x0A]*"}}
INTEGER = {**NUMBER, "properties": {"population_millions": {"type": "integer", "minimum": 0}}}
CLOSE_WITHIN = 64  # tokens: braces and key (about 25: the tiny vocabulary spells it), 17 + 1 + 9
# number characters and the end
MAX_TOKENS = 200  # what an unbounded number or whitespace run would use up


def prefer_digits_and_whitespace(engine) -> None:
    """Bias the model's logits so greedy sampling takes a digit-only token (not one leading
    with 0, which ends an integer part at once), else a whitespace-only token, whenever the
    grammar allows one: only the grammar can end it."""
    tok = engine.tokenizer
    bias = torch.zeros(engine.model_config.vocab_size)
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if text and text.isdigit() and text.isascii() and text[0] != "0":
            bias[i] = 1e4
        elif text and not text.strip():
            bias[i] = 5e3
    model = engine.runner.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: real(hidden) + bias.to(hidden.device)


def greedy(schema: dict, jump: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, jump_forward=jump,
                          structured={"type": "json", "schema": schema})


@pytest.mark.parametrize("schema", [NUMBER, LOOSE, PATTERN, INTEGER],
                         ids=["number", "whitespace_flexible", "whitespace_pattern", "integer"])
def test_a_model_preferring_digits_and_whitespace_forever_still_closes(make_tiny_engine,
                                                                       schema):
    engine = make_tiny_engine(num_blocks=128)
    prefer_digits_and_whitespace(engine)
    prompt = engine.tokenizer.encode("The population in millions:")
    results, _ = run(engine, {"n": (prompt, greedy(schema))})
    r = results["n"]
    assert r.final.finish_reason == "stop", r.text[:120]
    assert len(r.tokens) <= CLOSE_WITHIN and is_valid({"type": "json", "schema": schema}, r.text)
    number = re.search(r"-?(\d+)(?:\.(\d+))?", r.text)
    assert number is not None and len(number.group(1)) <= MAX_INT_DIGITS
    assert len(number.group(2) or "") <= MAX_FRACTION_DIGITS
    assert not re.search(r"\s{2,}|\n", r.text)  # the server's layout: no free whitespace
    assert_clean(engine)


def accepts(compiled, text: str, lltok: llguidance.LLTokenizer) -> bool:
    """Does the grammar take `text` as (a prefix of) its output?"""
    matcher = compiled.new_matcher()
    tokens = lltok.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error()


TOOLS = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["name", "arguments"],
    "properties": {"name": {"const": "f"}, "arguments": {"type": "object", "properties": {
        "x": {"type": "number"}, "free": {}}}}}}
LONG = "1" * (MAX_INT_DIGITS + 1)
FINE = "9" * MAX_INT_DIGITS + "." + "5" * MAX_FRACTION_DIGITS


@pytest.mark.parametrize("schema,prefix", [
    ({"type": "object"}, '{"a": '),  # json_object: values free
    ({"type": "object"}, '{"a": [{"b": '),  # nested free values
    (TOOLS, '[{"name": "f", "arguments": {"x": '),  # a tool's argument schema
    (TOOLS, '[{"name": "f", "arguments": {"free": '),
    ({"type": "array", "items": {"type": ["number", "null"]}}, "["),
    ({"type": "array", "items": {"type": "integer", "maximum": 10 ** 30}}, "["),
], ids=["json_object", "nested_free", "tool_number", "tool_free", "type_list", "wide_integer"])
def test_every_schema_derived_grammar_bounds_its_numbers(tiny_checkpoint, schema, prefix):
    engine_tok = _lltokenizer(tiny_checkpoint)
    compiled = compile_grammar(engine_tok, {"type": "json", "schema": schema})
    integer = "integer" in json.dumps(schema)
    assert accepts(compiled, prefix + "42", engine_tok)
    assert accepts(compiled, prefix + ("9" * MAX_INT_DIGITS if integer else FINE), engine_tok)
    assert not accepts(compiled, prefix + LONG, engine_tok)
    assert not accepts(compiled, prefix + "1." + "0" * (MAX_FRACTION_DIGITS + 1), engine_tok)
    assert not accepts(compiled, prefix + "1e5", engine_tok)
    assert not accepts(compiled, prefix + "  ", engine_tok)


def test_a_schemas_own_bounds_and_step_still_hold(tiny_checkpoint):
    lltok = _lltokenizer(tiny_checkpoint)
    schema = {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}
    compiled = compile_grammar(lltok, {"type": "json", "schema": schema})
    assert accepts(compiled, "12.75", lltok) and not accepts(compiled, "12.3", lltok)
    assert not accepts(compiled, "-1", lltok) and not accepts(compiled, "101", lltok)


def _lltokenizer(checkpoint) -> llguidance.LLTokenizer:
    from runtime.structured.compiler import make_lltokenizer
    cfg = checkpoint.config
    return make_lltokenizer(checkpoint.tokenizer, cfg.vocab_size, cfg.eos_token_ids)


def test_jump_forward_false_appends_no_forced_token(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=128)
    prompt = engine.tokenizer.encode("The population in millions:")
    params = {"on": greedy(NUMBER, jump=True), "off": greedy(NUMBER, jump=False)}
    seen: dict[str, list] = {}
    for name, p in params.items():
        results, steps = run(engine, {name: (prompt, p)})
        seen[name] = [results[name], steps]
    (on, on_steps), (off, off_steps) = seen["on"], seen["off"]
    assert off.text == on.text and off.final.finish_reason == "stop"
    assert off.final.timing["forced_tokens"] == 0 < on.final.timing["forced_tokens"]
    assert all(len(o.new_token_ids) <= 1 for o in off.outputs)  # one sampled token a step
    assert off_steps > on_steps
    assert_clean(engine)


def test_the_api_carries_jump_forward_false():
    from gateway.openai.requests import parse_request
    body = {"messages": [{"role": "user", "content": "hi"}], "jump_forward": False,
            "response_format": {"type": "json_object"}}
    assert parse_request("chat", body).sampling_params(8).jump_forward is False
