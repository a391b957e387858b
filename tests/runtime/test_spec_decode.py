"""Speculative decoding: exact greedy output, the target's distribution kept, nothing leaked."""
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.make_draft import write_draft
from runtime.spec_decode.ngram import propose_ngram

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "def add(a, b):\n    return a + b\n\ndef add(a, b):",
         "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 and prices 0 1 2 3"]


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint, tmp_path_factory):
    return write_draft(tiny_checkpoint, 1, str(tmp_path_factory.mktemp("draft") / "d"))


def spec_options(draft_dir):
    return ["ngram", "self:1", f"draft:{draft_dir}"]


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose_ngram([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the most recent match wins
    assert propose_ngram([1, 2, 3], 4) == []


def test_spec_flag_parsing():
    assert SpecConfig.parse("self:3").num_layers == 3
    assert SpecConfig.parse("draft:/m").draft_path == "/m"
    for bad in ("self:0", "self:x", "draft:", "medusa"):
        with pytest.raises(ValueError):
            SpecConfig.parse(bad)


@pytest.mark.parametrize("overrides", [
    {}, {"max_num_batched_tokens": 7},  # chunked prefill
    {"num_blocks": 20},  # preemption
])
def test_greedy_output_identical_with_every_proposer(make_tiny_engine, draft_dir, overrides):
    base = make_tiny_engine(**overrides)
    prompts = [base.tokenizer.encode(t) for t in TEXTS]
    expected = base.generate(prompts, GREEDY)
    for spec in spec_options(draft_dir):
        engine = make_tiny_engine(spec=spec, **overrides)
        assert engine.generate(prompts, GREEDY) == expected, spec
        assert engine.counters.spec_draft_tokens > 0, spec
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_greedy_identical_on_prefix_cache_hits(make_tiny_engine, draft_dir):
    base = make_tiny_engine()
    prompt = base.tokenizer.encode(TEXTS[0])
    expected = base.generate([prompt], GREEDY)[0]
    engine = make_tiny_engine(spec="self:1")
    engine.generate([prompt], GREEDY)
    engine.add_request("again", prompt, GREEDY)
    tokens, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            tokens += o.new_token_ids
            final = o
    assert final.usage.cached_tokens > 0 and tokens == expected


def test_a_request_can_opt_out(make_tiny_engine):
    engine = make_tiny_engine(spec="ngram")
    prompt = engine.tokenizer.encode(TEXTS[0])
    engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                             speculative=False))
    assert engine.counters.spec_draft_tokens == 0


def chi_square_critical(df: int, z: float = 2.326) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 2.326: p = 0.01)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def second_tokens(engine, prompt, n, temperature=1.0):
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=1000 + i,
                             ignore_eos=True) for i in range(n)]
    return Counter(out[1] for out in engine.generate([prompt] * n, params))


def test_sampled_distribution_is_kept(make_tiny_engine):
    """Token frequencies at temperature 1 with speculation match those without (chi-square
    homogeneity test at p > 0.01); the second token is the one drafts can decide."""
    n = 1500
    off = make_tiny_engine(max_num_seqs=64)
    on = make_tiny_engine(max_num_seqs=64, spec="self:1", spec_max_batch=1000,
                          num_spec_tokens=1)
    prompt = off.tokenizer.encode("The quick brown")
    a, b = second_tokens(off, prompt, n), second_tokens(on, prompt, n)
    assert on.counters.spec_draft_tokens >= n // 2
    assert 0 < on.counters.spec_accepted_tokens < on.counters.spec_draft_tokens
    tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 20]
    rest_a = n - sum(a[t] for t in tokens)
    rest_b = n - sum(b[t] for t in tokens)
    table = [(a[t], b[t]) for t in tokens] + [(rest_a, rest_b)]
    stat = sum((x - (x + y) / 2) ** 2 / ((x + y) / 2) * 2 for x, y in table if x + y)
    assert len(table) >= 4
    assert stat < chi_square_critical(len(table) - 1), (stat, table)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(0, 7)), max_size=40))
def test_random_speculative_runs_with_aborts_leak_nothing(make_tiny_engine, ops):
    engine = make_tiny_engine(num_blocks=30, spec="self:1", max_num_batched_tokens=24)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    n = 0
    for op, which in ops:
        if op == "add":
            temp = 0.0 if which % 2 else 1.0
            engine.add_request(f"r{n}", prompts[which % 3], SamplingParams(
                max_tokens=which + 2, temperature=temp, seed=which, ignore_eos=True))
            n += 1
        elif op == "abort" and engine.requests:
            engine.abort_request(sorted(engine.requests)[which % len(engine.requests)])
        else:
            engine.step()
        refs = sum(b.ref_cnt for b in engine.kv.pool.blocks)
        assert refs == sum(len(engine.kv.block_ids(rid)) for rid in engine.requests)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.model
def test_smollm_greedy_identical_with_each_proposer(smollm_checkpoint, tmp_path):
    draft = write_draft(smollm_checkpoint, 8, str(tmp_path / "draft"))
    tok = smollm_checkpoint.tokenizer
    passage = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
               "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                        "Repeat this code exactly:\n" + passage}]))
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run(spec, **kw):
        cfg = dict(kv_cache_bytes=64 << 20, max_num_batched_tokens=64, spec=spec)
        cfg.update(kw)
        engine = LLMEngine(smollm_checkpoint, EngineConfig(**cfg))
        out = engine.generate([prompt, prompt], params)  # the second one hits the cache
        return out, engine
    expected, _ = run("off")
    for spec in ("ngram", "self:8", f"draft:{draft}"):
        got, engine = run(spec)
        assert got == expected, spec
        assert engine.counters.spec_draft_tokens > 0, spec  # proposals were verified
        if spec == "ngram":  # copying a passage: lookups hit
            assert engine.counters.spec_accepted_tokens > 0
    got, engine = run("ngram", num_blocks=12, block_size=16)  # tight: preemption
    assert got == expected


def test_cli_generate_with_speculation(tiny_model_dir):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "runtime", "--model", str(tiny_model_dir),
                          "--spec", "ngram", "generate", "--prompt", TEXTS[0],
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "completion tokens" in out.stderr


def test_governor_weighs_acceptance_against_draft_cost():
    from runtime.spec_decode.governor import Governor
    free = Governor(SpecConfig("ngram", num_tokens=4), draft_cost=0.0)
    costly = Governor(SpecConfig("self", num_layers=24, num_tokens=4), draft_cost=0.8)
    assert free.best_k(0.9)[0] == 4  # lookups are free: guess as far as allowed
    assert costly.best_k(0.22)[0] == 0  # a weak, expensive drafter does not pay
    assert costly.best_k(0.95)[0] >= 1
    assert free.best_k(0.0)[0] == 0
