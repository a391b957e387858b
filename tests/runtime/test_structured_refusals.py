"""Grammars that do not compile, or compile slowly: refused as the request's own 400 (an
engine output, then a worker's Rejected frame), never a stalled step for anyone else."""
from __future__ import annotations

import io
import threading

import pytest

import runtime.structured.compiler as compiler_module
from contract.errors import InvalidRequestError
from contract.frames import AddRequest, Rejected, Step, read_frame_blocking
from contract.sampling_params import SamplingParams
from runtime.transport.worker import Worker
from tests.runtime.structured_helpers import SPECS, assert_clean, drain, is_valid, run

BAD = {"type": "json", "param": "response_format",
       "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}
FREE = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def constrained(spec: dict) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0.0, structured=spec)


@pytest.fixture
def gate(monkeypatch):
    """Compiles wait until the test opens the gate (a compile as slow as the test wants)."""
    opened = threading.Event()
    real = compiler_module.compile_grammar

    def slow(tokenizer, spec):
        opened.wait(30)
        return real(tokenizer, spec)
    monkeypatch.setattr(compiler_module, "compile_grammar", slow)
    yield opened
    opened.set()


def test_a_grammar_that_fails_later_is_refused_and_then_refused_at_once(
        make_tiny_engine, gate):
    engine = make_tiny_engine()
    prompt = engine.tokenizer.encode("The quick brown fox")
    # the compile is held until both are added: without the gate a fast failure could
    # finish before add_request looks, and this would test the at-once refusal twice
    engine.add_request("bad", prompt, constrained(BAD))
    engine.add_request("ok", prompt, FREE)
    gate.set()
    results, _ = drain(engine, ["bad", "ok"])
    bad = results["bad"]
    assert [o.finish_reason for o in bad.outputs] == ["rejected"] and bad.tokens == []
    assert bad.final.error["param"] == "response_format"
    assert bad.final.error["kind"] == "GrammarError"
    assert "does not exist" in bad.final.error["message"]
    assert results["ok"].final.finish_reason == "length" and len(results["ok"].tokens) == 5
    with pytest.raises(InvalidRequestError, match="does not exist") as info:
        engine.add_request("again", prompt, constrained({**BAD, "param": "tools"}))
    assert info.value.param == "tools" and "again" not in engine.requests
    assert_clean(engine)


def test_a_compile_past_its_time_limit_is_refused(make_tiny_engine, gate):
    engine = make_tiny_engine()
    engine.structured.compile_timeout_s = 0.05
    prompt = engine.tokenizer.encode("Paris is")
    results, _ = run(engine, {"slow": (prompt, constrained(SPECS["regex"])),
                              "ok": (prompt, FREE)})
    assert results["slow"].final.finish_reason == "rejected"
    assert "longer than 0.05 s" in results["slow"].final.error["message"]
    assert len(results["ok"].tokens) == 5
    assert_clean(engine)


def test_others_decode_while_a_grammar_compiles_and_its_prompt_runs_meanwhile(
        make_tiny_engine, gate):
    engine = make_tiny_engine()
    prompt = engine.tokenizer.encode("Numbers: 0 1 2 3 42 and more words")
    engine.add_request("c", prompt, constrained(SPECS["json"]))
    engine.add_request("f", prompt, FREE)
    seen: dict[str, list] = {"c": [], "f": []}
    while "f" in engine.requests:
        for out in engine.step()[0]:
            seen[out.request_id].append(out)
    assert seen["f"][-1].finish_reason == "length" and seen["c"] == []
    waiting = engine.requests["c"]
    assert waiting.num_computed_tokens == waiting.num_prompt_tokens - 1  # all but the sampler
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            seen[out.request_id].append(out)
    assert seen["c"][-1].finish_reason == "stop"
    assert is_valid(SPECS["json"], "".join(o.new_text for o in seen["c"]))
    assert_clean(engine)


def test_abort_while_compiling_frees_everything(make_tiny_engine, gate):
    engine = make_tiny_engine()
    engine.add_request("c", engine.tokenizer.encode("The quick"), constrained(SPECS["choice"]))
    engine.step()
    final = engine.abort_request("c")
    assert final is not None and final.finish_reason == "abort" and final.new_token_ids == []
    gate.set()
    assert_clean(engine)


def test_the_worker_sends_a_late_refusal_as_a_rejected_frame(make_tiny_engine):
    engine = make_tiny_engine()
    out = io.BytesIO()
    worker = Worker(engine, out)
    prompt = engine.tokenizer.encode("The quick brown fox")

    def add(rid, params):
        worker.add(AddRequest(rid, prompt, params))
    add("bad", constrained(BAD))
    add("ok", constrained(SPECS["choice"]))
    while engine.has_unfinished_requests():
        worker.step()
    add("bad-again", constrained(BAD))  # known bad now: refused at once
    out.seek(0)
    frames = []
    while (frame := read_frame_blocking(out)) is not None:
        frames.append(frame)
    rejected = [f for f in frames if isinstance(f, Rejected)]
    assert [f.id for f in rejected] == ["bad", "bad-again"]
    assert all(f.error["param"] == "response_format" for f in rejected)
    outputs = [o for f in frames if isinstance(f, Step) for o in f.outputs]
    assert {o["id"] for o in outputs} == {"ok"} and outputs[-1]["reason"] == "stop"
    assert is_valid(SPECS["choice"], "".join(o["text"] for o in outputs))
    assert_clean(engine)


def test_an_imported_request_replays_its_tokens_into_the_grammar(make_tiny_engine):
    """Disaggregation: a decode worker imports a request whose first tokens another worker
    sampled; its matcher replays them once compiled, or refuses tokens the grammar forbids."""
    engine = make_tiny_engine()
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps")
    spec = {"type": "choice", "choices": ["beta gamma", "delta"], "param": "response_format"}
    good, bad = tok.encode("beta")[:1], tok.encode("zzz")[:1]
    for rid, first in (("good", good), ("bad", bad)):
        engine.import_request(rid, prompt, first, constrained(spec))
        engine.finish_import(rid)
    seen: dict[str, list] = {"good": [], "bad": []}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            seen[out.request_id].append(out)
    assert [o.finish_reason for o in seen["bad"]] == ["rejected"]
    assert "do not match" in seen["bad"][0].error["message"]
    text = tok.decode(good + [t for o in seen["good"] for t in o.new_token_ids])
    assert text == "beta gamma" and seen["good"][-1].finish_reason == "stop"
    assert_clean(engine)
