"""The governor in the engine: greedy output is the same however it switches speculation on
and off, and a verification step's linears take the quantized kernel a decode step takes."""
import pytest
import torch

from contract.sampling_params import SamplingParams
from runtime.loading.quantization import Int8Weight
from runtime.models.linear import SMALL_STEP_ROWS, Linear

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
         "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"]


def scripted_costs(engine, cheap_until: int):
    """Feed the governor scripted step times instead of the real ones: verifying costs 1% of a
    plain step until step `cheap_until`, then three times one. Returns the per-step list of
    proposals verified."""
    governor = engine.scheduler.governor
    real = governor.observe_step
    seen: list[int] = []

    def observe(out, seconds):
        extra = sum(s.num_spec for s in out.scheduled)
        seen.append(extra)
        scale = 1.01 if len(seen) <= cheap_until else 3.0
        real(out, 0.01 * (scale if extra else 1.0))
    governor.observe_step = observe
    return seen


@pytest.mark.parametrize("spec", ["ngram", "self:1"])
def test_greedy_identical_while_the_governor_switches(make_tiny_engine, spec):
    base = make_tiny_engine()
    prompts = [base.tokenizer.encode(t) for t in TEXTS]
    expected = [base.generate([p], GREEDY)[0] for p in prompts]
    engine = make_tiny_engine(spec=spec, num_spec_tokens=3)
    seen = scripted_costs(engine, cheap_until=12)
    got = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert got == expected
    assert engine.counters.spec_draft_tokens > 0
    # once verification measured dear, only the rare probes speculate
    late = seen[20:]
    assert sum(1 for x in late if x) <= 2, seen
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_linear_path_keeps_small_steps_on_the_quantized_kernel():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    low = Linear(Int8Weight(w).dequantized(), packed=Int8Weight(w), max_quant_rows=2)
    assert [low.path(r) for r in (1, 5, SMALL_STEP_ROWS)] == ["packed"] * 3
    assert low.path(SMALL_STEP_ROWS + 1) == "float"  # past it the measured crossover rules
    high = Linear(Int8Weight(w).dequantized(), packed=Int8Weight(w), max_quant_rows=64)
    assert high.path(64) == "packed" and high.path(65) == "float"
    never = Linear(Int8Weight(w).dequantized(), packed=Int8Weight(w), max_quant_rows=0)
    assert never.path(1) == never.path(5) == "float"  # a decode step's own choice
    x = torch.randn(5, 64)
    torch.testing.assert_close(low(x), Int8Weight(w).matmul(x))


def test_verification_step_reads_the_int8_weights(make_tiny_engine, monkeypatch):
    """One stream verifying k = 4 proposals runs 5 rows through every linear: with crossovers
    measured as low as 1 row (a busy start), they still take the int8 kernel, as decode does,
    and greedy output matches speculation off."""
    def engine_with_low_crossover(**kw):
        engine = make_tiny_engine(quantization="int8", **kw)
        for lin in engine.runner.model.linears():
            assert lin.packed is not None
            lin.max_quant_rows = 1
        return engine

    off = engine_with_low_crossover()
    prompts = [off.tokenizer.encode(t) for t in TEXTS]
    expected = [off.generate([p], GREEDY)[0] for p in prompts]
    calls: list[tuple[int, str]] = []
    path = Linear.path

    def spy(self, rows):
        chosen = path(self, rows)
        calls.append((rows, chosen))
        return chosen
    monkeypatch.setattr(Linear, "path", spy)
    on = engine_with_low_crossover(spec="ngram", num_spec_tokens=4)
    assert [on.generate([p], GREEDY)[0] for p in prompts] == expected
    assert on.counters.spec_draft_tokens > 0
    verify_rows = {rows for rows, _ in calls if 1 < rows <= 5}
    assert verify_rows, calls
    assert all(chosen == "packed" for rows, chosen in calls if rows <= 5)  # k + 1 and less
