"""Constrained decoding in the engine, on the tiny model: outputs match their grammar and end
as they should, and batching, chunking, preemption, the prefix cache, seeds, speculation and
jump-forward change nothing they must not."""
from __future__ import annotations

import pytest
import torch

from contract.sampling_params import SamplingParams, choice_seed
from tests.runtime.structured_helpers import SPECS, assert_clean, is_valid, run


def greedy(spec: str | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 40), temperature=0.0,
                          structured=SPECS[spec] if spec else None, **kw)


def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("The quick brown fox", "Paris is the capital of",
                                    "def add(a, b):\n    return", "Numbers: 0 1 2 3 42")]


def mixed_jobs(tok, free: SamplingParams) -> dict:
    ps = prompts(tok)
    jobs = {f"free{i}": (p, free) for i, p in enumerate(ps)}
    jobs.update({name: (ps[i], greedy(name)) for i, name in enumerate(SPECS)})
    return jobs


@pytest.mark.parametrize("jump", [True, False])
def test_each_kind_matches_and_stops_at_the_grammars_end(make_tiny_engine, jump):
    engine = make_tiny_engine()
    eos = engine.model_config.eos_token_ids[0]
    results, _ = run(engine, {name: (prompts(engine.tokenizer)[1], greedy(name,
                                                                        jump_forward=jump))
                              for name in SPECS})
    for name, r in results.items():
        assert is_valid(SPECS[name], r.text), (name, r.text)
        assert r.final.finish_reason == "stop" and r.final.stop_reason == eos
        assert r.tokens[-1] == eos and r.final.usage.completion_tokens == len(r.tokens)
        assert r.text == engine.tokenizer.decode(r.tokens)
        assert (r.final.timing["forced_tokens"] > 0) == jump
    assert_clean(engine)


def test_max_tokens_cuts_a_schema_short_with_length(make_tiny_engine):
    engine = make_tiny_engine()
    results, _ = run(engine, {"cut": (prompts(engine.tokenizer)[0], greedy("json", max_tokens=3))})
    r = results["cut"]
    assert r.final.finish_reason == "length" and len(r.tokens) == 3
    assert r.final.usage.completion_tokens == 3 and r.text.startswith('{"')


@pytest.mark.parametrize("free", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_free_requests_beside_constrained_ones_are_unchanged(make_tiny_engine, free):
    engine = make_tiny_engine()
    jobs = mixed_jobs(engine.tokenizer, free)
    alone = {rid: run(engine, {rid: job})[0][rid] for rid, job in jobs.items()}
    together, _ = run(engine, jobs)
    for rid in jobs:
        assert together[rid].tokens == alone[rid].tokens, rid
    assert_clean(engine)


def test_preempted_and_recomputed_constrained_requests_equal_uninterrupted(make_tiny_engine):
    roomy, tight = make_tiny_engine(num_blocks=64), make_tiny_engine(num_blocks=20)
    jobs = mixed_jobs(roomy.tokenizer, SamplingParams(max_tokens=30, temperature=0.0,
                                                      ignore_eos=True))
    expected, _ = run(roomy, jobs)
    got, _ = run(tight, jobs)
    assert tight.counters.num_preemptions > 0
    assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in expected.items()}
    assert_clean(tight)


def test_chunked_prefill_and_prefix_cache_hits_change_nothing(make_tiny_engine):
    big, small = make_tiny_engine(max_num_batched_tokens=256), \
        make_tiny_engine(max_num_batched_tokens=5)
    prompt = big.tokenizer.encode("Caching the prefix of a prompt saves compute for all.")
    jobs = {name: (prompt, greedy(name)) for name in SPECS}
    expected, _ = run(big, jobs)
    assert {k: r.tokens for k, r in run(small, jobs)[0].items()} == \
        {k: r.tokens for k, r in expected.items()}
    again, _ = run(big, {f"{k}2": job for k, job in jobs.items()})  # the prompt is cached now
    for name in SPECS:
        assert again[f"{name}2"].tokens == expected[name].tokens
        assert again[f"{name}2"].final.usage.cached_tokens > 0
    assert_clean(big)


@pytest.mark.parametrize("spec", ["ngram", "self:1"])
@pytest.mark.parametrize("jump", [True, False])
def test_speculation_on_and_off_give_the_same_greedy_outputs(make_tiny_engine, spec, jump):
    tok = make_tiny_engine().tokenizer
    # the prompt repeats the structure, so n-gram lookups propose it (and its mistakes)
    prompt = tok.encode('{"id": 5, "tag": "red", "ok": true} (1,2,3) abc-12 beta gamma ' * 2)
    jobs = {name: (prompt, greedy(name, jump_forward=jump)) for name in SPECS}
    off, _ = run(make_tiny_engine(), jobs)
    engine = make_tiny_engine(spec=spec, num_spec_tokens=3)
    on, _ = run(engine, jobs)
    assert engine.counters.spec_draft_tokens > 0
    assert {k: r.tokens for k, r in on.items()} == {k: r.tokens for k, r in off.items()}
    assert all(is_valid(SPECS[k], r.text) for k, r in on.items())
    assert_clean(engine)


def test_seeded_constrained_sampling_is_reproducible_and_n_choices_share_a_compile(
        make_tiny_engine):
    engine = make_tiny_engine()
    ps = prompts(engine.tokenizer)
    seeded = [SamplingParams(max_tokens=40, temperature=1.0, seed=choice_seed(11, i),
                             structured=SPECS["json"]) for i in range(3)]  # n = 3
    alone = run(engine, {f"c{i}": (ps[0], p) for i, p in enumerate(seeded)})[0]
    noise = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    mixed = run(engine, {"n1": (ps[1], noise), **{f"c{i}": (ps[0], p)
                                                   for i, p in enumerate(seeded)},
                         "n2": (ps[2], noise)})[0]
    for i in range(3):
        assert mixed[f"c{i}"].tokens == alone[f"c{i}"].tokens
        assert is_valid(SPECS["json"], alone[f"c{i}"].text)
    assert len({tuple(alone[f"c{i}"].tokens) for i in range(3)}) > 1  # distinct choices
    assert engine.structured.compiler.num_compiles == 1


def test_logprobs_come_from_the_masked_distribution(make_tiny_engine):
    engine = make_tiny_engine()
    tok, eos = engine.tokenizer, engine.model_config.eos_token_ids[0]
    spec = {"type": "regex", "pattern": "[a-z ]{3,12}"}
    prompt = prompts(tok)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=spec,
                            logprobs=True, top_logprobs=4)
    r = run(engine, {"lp": (prompt, params)})[0]["lp"]
    entries = [e for o in r.outputs for e in (o.logprobs or [])]
    assert len(entries) == len(r.tokens)  # no forced tokens go without a distribution
    vocab = range(engine.model_config.vocab_size)
    texts = [tok.decode([t], skip_special_tokens=False) for t in vocab]
    for i, entry in enumerate(entries):
        done = len(tok.decode(r.tokens[:i]))
        allowed = [t for t in vocab if t == eos and done >= 3 or 0 < len(texts[t]) <= 12 - done
                   and all(c in "abcdefghijklmnopqrstuvwxyz " for c in texts[t])]
        logits = engine.prompt_logits(prompt + r.tokens[:i])[-1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        expected = torch.log_softmax(masked, dim=-1)
        assert entry.token_id == r.tokens[i] and entry.token_id in allowed
        assert entry.logprob == pytest.approx(expected[entry.token_id].item(), abs=1e-4)
        assert {t for t, _ in entry.top} <= set(allowed)  # ruled-out tokens are no alternative
        assert len(entry.top) == min(4, len(allowed))


def test_stop_strings_apply_inside_forced_text(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(engine.tokenizer)[0]
    spec = {"type": "choice", "choices": ["hello world again"]}
    for jump in (True, False):
        r = run(engine, {"s": (prompt, SamplingParams(max_tokens=30, temperature=0.0,
                                                      structured=spec, stop=("wor",),
                                                      jump_forward=jump))})[0]["s"]
        assert r.text == "hello " and r.final.finish_reason == "stop"
        assert r.final.stop_reason == "wor"
    assert_clean(engine)


def test_jump_forward_saves_steps_bills_forced_tokens_and_keeps_greedy_output(
        make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(engine.tokenizer)[2]
    jobs = lambda jump: {"j": (prompt, greedy("json", jump_forward=jump))}  # noqa: E731
    on, steps_on = run(engine, jobs(True))
    off, steps_off = run(engine, jobs(False))
    # llguidance forces only the tokenization a free choice would be masked to, so greedy
    # decoding makes the same tokens either way; their KV, computed a step later, must agree
    assert on["j"].tokens == off["j"].tokens and is_valid(SPECS["json"], on["j"].text)
    forced = on["j"].final.timing["forced_tokens"]
    assert forced > 0 and steps_on < steps_off
    assert on["j"].final.usage.completion_tokens == len(on["j"].tokens)
    assert_clean(engine)
