"""Structured-output pieces without the engine: spec shapes and their errors, compiles and their
cache, bitmask unpacking and masking (brute force against the library's own answers)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import InvalidRequestError
from contract.sampling_params import SamplingParams
from contract.structured_spec import MAX_SPEC_BYTES, spec_key, validate_spec
from runtime.structured.compiler import GrammarCompiler
from runtime.structured.masks import MaskMaker, TokenMask, allowed_tokens

GOOD = [{"type": "json"}, {"type": "json", "schema": {"type": "integer"}},
        {"type": "regex", "pattern": "[ab]+"}, {"type": "choice", "choices": ["x", "y"]},
        {"type": "grammar", "grammar": 'start: "yes" | "no"'},
        {"type": "grammar", "grammar": 'root ::= "yes" | "no"', "param": "grammar"}]
BAD = [([], "must be an object"), ({"type": "xml"}, "type must be one of"),
       ({"type": "json", "schema": "{}"}, "must be a JSON object"),
       ({"type": "regex"}, "needs 'pattern'"), ({"type": "regex", "pattern": ""}, "empty"),
       ({"type": "choice", "choices": []}, "at least one"),
       ({"type": "choice", "choices": ["a", 3]}, "non-empty string"),
       ({"type": "choice", "choices": "ab"}, "must be a list"),
       ({"type": "grammar", "grammar": "start: x", "extra": 1}, "unknown fields"),
       ({"type": "regex", "pattern": "a", "param": 5}, "param must be a string")]


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_pass(spec):
    assert SamplingParams(structured=spec).structured_key == validate_spec(spec)


@pytest.mark.parametrize("spec,why", BAD)
def test_bad_specs_name_the_clients_param(spec, why):
    with pytest.raises(InvalidRequestError, match=why) as info:
        validate_spec(spec)
    assert info.value.param == "structured"
    if isinstance(spec, dict) and "param" not in spec:  # the client's field is named
        with pytest.raises(InvalidRequestError, match=why) as info:
            SamplingParams(structured={**spec, "param": "response_format"})
        assert info.value.param == "response_format"


def test_spec_size_cap_and_jump_forward_type():
    big = {"type": "choice", "choices": ["x" * 1000] * (MAX_SPEC_BYTES // 1000 + 1),
           "param": "tools"}
    with pytest.raises(InvalidRequestError, match="larger than") as info:
        SamplingParams(structured=big)
    assert info.value.param == "tools"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(jump_forward="yes")  # type: ignore[arg-type]
    assert info.value.param == "jump_forward"


def test_key_ignores_order_and_param_and_names_json_object():
    a = {"type": "json", "schema": {"type": "object", "required": ["a"]}, "param": "x"}
    b = {"schema": {"required": ["a"], "type": "object"}, "type": "json"}
    assert spec_key(a) == spec_key(b)
    assert spec_key({"type": "json"}) == spec_key({"type": "json", "schema": {"type": "object"}})
    assert spec_key(a) != spec_key({"type": "json", "schema": {"type": "object"}})


# ---- compiles --------------------------------------------------------------------------------
@pytest.fixture
def compiler(tiny_checkpoint):
    cfg = tiny_checkpoint.config
    return GrammarCompiler(tiny_checkpoint.tokenizer, cfg.vocab_size, cfg.eos_token_ids,
                           cache_size=3)


def _result(compiler, spec):
    return compiler.submit(spec_key(spec), spec).future.result(timeout=30)


@pytest.mark.parametrize("spec,why", [
    ({"type": "json", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/no"}}}},
     "does not exist"),
    ({"type": "json", "schema": {"type": "strin"}}, "Invalid type"),
    ({"type": "json", "schema": {"type": "string", "format": "emailx"}}, "Unknown format"),
    ({"type": "regex", "pattern": "(ab"}, "unclosed group"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "unknown name"),
])
def test_bad_grammars_fail_with_the_libraries_reason(compiler, spec, why):
    result = _result(compiler, spec)
    assert isinstance(result, str) and why in result


@pytest.mark.parametrize("text", ['start: "yes" | "no"', 'root ::= "yes" | "no"'],
                         ids=["lark", "gbnf"])
def test_grammars_compile_from_lark_or_gbnf(compiler, tiny_checkpoint, text):
    compiled = _result(compiler, {"type": "grammar", "grammar": text})
    matcher = compiled.new_matcher()
    tok = tiny_checkpoint.tokenizer
    assert matcher.consume_tokens(tok.encode("no")) and matcher.is_accepting()
    assert compiled.new_matcher().validate_tokens(tok.encode("maybe")) == 0


def test_compiles_are_cached_by_content_in_a_bounded_lru(compiler):
    specs = [{"type": "regex", "pattern": p} for p in ("a+", "b+", "c+", "d+")]
    first = compiler.submit(spec_key(specs[0]), specs[0])
    again = compiler.submit(spec_key({**specs[0], "param": "other"}), specs[0])
    assert again is first and compiler.num_compiles == 1 and compiler.num_cache_hits == 1
    for spec in specs[1:]:
        _result(compiler, spec)
    assert compiler.num_compiles == 4
    assert compiler.submit(spec_key(specs[0]), specs[0]) is not first  # evicted: compiled anew
    assert compiler.num_compiles == 5
    result = first.future.result(timeout=30)
    assert not isinstance(result, str) and first.seconds is not None


# ---- masks -----------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1, max_size=6),
       st.integers(1, 200))
def test_unpacked_bits_are_the_tokens_bits(words, vocab):
    bits = torch.tensor([words], dtype=torch.int32)
    allowed = allowed_tokens(bits, vocab)
    expected = [t < 32 * len(words) and bool((words[t // 32] >> (t % 32)) & 1)
                for t in range(vocab)]
    assert allowed.shape == (1, vocab) and allowed[0].tolist() == expected


def test_mask_matches_the_matchers_verdicts_and_leaves_other_rows(compiler, tiny_checkpoint):
    cfg = tiny_checkpoint.config
    compiled = _result(compiler, {"type": "regex", "pattern": "(ab|ba)+c"})
    matcher = compiled.new_matcher()
    masks = MaskMaker(cfg.vocab_size, threads=1)
    bits, first = masks.fill([(matcher, [])])
    allowed = allowed_tokens(bits, cfg.vocab_size)[0]
    by_library = [t for t in range(cfg.vocab_size) if matcher.validate_tokens([t]) == 1]
    assert allowed.nonzero().flatten().tolist() == by_library and first == [0]
    logits = torch.randn(3, cfg.vocab_size)
    masked = TokenMask([1], bits).apply(logits)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.equal(masked[1][allowed], logits[1][allowed])
    assert bool((masked[1][~allowed] == float("-inf")).all())
    assert masks.stats.num_rows == 1


def test_draft_rows_follow_the_proposals_and_leave_the_matcher(compiler, tiny_checkpoint):
    tok, cfg = tiny_checkpoint.tokenizer, tiny_checkpoint.config
    matcher = _result(compiler, {"type": "regex", "pattern": "abab"}).new_matcher()
    drafts = tok.encode("ab")[:1] + [tok.eos_token_ids[0]]  # a valid token, then a refused one
    bits, _ = MaskMaker(cfg.vocab_size, threads=1).fill([(matcher, drafts)])
    allowed = allowed_tokens(bits, cfg.vocab_size)
    assert bool(allowed[0, drafts[0]]) and not bool(allowed[1, drafts[1]])
    assert bool(allowed[2].all())  # past a refused proposal: never read, left all-allowed
    assert matcher.validate_tokens(tok.encode("abab")) == len(tok.encode("abab"))  # untouched


def test_the_fake_engine_emits_the_first_choice_and_ignores_other_specs(tiny_checkpoint):
    from runtime.fake_engine import FakeEngine
    engine = FakeEngine(tiny_checkpoint.tokenizer, step_seconds=0)
    choice = {"type": "choice", "choices": ["beta gamma", "delta"]}
    engine.add_request("c", [5, 6], SamplingParams(max_tokens=20, structured=choice))
    engine.add_request("j", [5, 6], SamplingParams(max_tokens=3, structured={"type": "json"},
                                                   jump_forward=False))
    outs: dict[str, list] = {"c": [], "j": []}
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            outs[o.request_id].append(o)
    assert "".join(o.new_text for o in outs["c"]) == "beta gamma"
    assert outs["c"][-1].finish_reason == "stop"
    assert outs["c"][-1].stop_reason == tiny_checkpoint.tokenizer.eos_token_ids[0]
    assert outs["j"][-1].finish_reason == "length" and len(outs["j"]) == 3
