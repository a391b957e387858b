"""The inter-token budget in the engine (the tiny random model): it learns from every step the
engine times, and capping prefill beside decodes never changes what is generated."""
from contract.sampling_params import SamplingParams
from runtime.scheduling.itl_budget import ItlBudget
from runtime.scheduling.step_cost import StepCostModel, StepShape
from tests.runtime.test_engine import assert_idle_and_clean, prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def staggered(engine, ps):
    """The first prompt starts alone; each later one arrives while the earlier ones decode, so
    its prefill shares steps with their decodes. Returns each request's tokens and every
    step's stats."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    stats = []
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p * 4, GREEDY)  # long enough to need several chunks
        for _ in range(2):
            outputs, s = engine.step()
            stats.append(s)
            for o in outputs:
                tokens[o.request_id] += o.new_token_ids
    while engine.has_unfinished_requests():
        outputs, s = engine.step()
        stats.append(s)
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(ps))], stats


def scripted_cost() -> StepCostModel:
    """A cost model taught a machine where a prompt token costs a millisecond and a decode row
    two, on top of five per step."""
    model = StepCostModel()
    for p, d in [(0, 1), (0, 3), (8, 2), (30, 1), (60, 0), (4, 4)]:
        model.observe(StepShape(p, d, 0), 0.005 + 0.001 * p + 0.002 * d)
    return model


def test_outputs_are_identical_with_and_without_the_budget(make_tiny_engine):
    off = make_tiny_engine(max_num_batched_tokens=64)
    off.scheduler.itl = None
    on = make_tiny_engine(max_num_batched_tokens=64)
    # 15 ms a step: beside a few decodes only a handful of prompt tokens fit, and the minimum
    # chunk is small, so every later prompt is cut into capped chunks
    on.scheduler.itl = ItlBudget(target_s=0.015, cost=scripted_cost(), min_chunk=3)
    on.scheduler.itl.observe = lambda sched, seconds: None  # keep the scripted machine
    ps = prompts(on.tokenizer)
    expected, off_stats = staggered(off, ps)
    got, on_stats = staggered(on, ps)
    assert got == expected
    assert all(len(t) == 16 for t in got)
    mixed = [s for s in on_stats if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed and all(s.num_prefill_tokens <= 8 for s in mixed)  # the cap held ...
    assert max(s.num_prefill_tokens for s in off_stats if s.num_decode_tokens) > 8  # ... and bit
    assert_idle_and_clean(on)


def test_the_engine_teaches_the_cost_model_every_step(make_tiny_engine):
    assert make_tiny_engine().scheduler.itl is None  # off by default
    engine = make_tiny_engine(itl_target_ms=None)
    budget = engine.scheduler.itl
    assert budget is not None and budget.paces  # None: automatic
    _, stats = staggered(engine, prompts(engine.tokenizer))
    ran = [s for s in stats if s.num_decode_tokens or s.num_prefill_tokens]
    assert budget.cost.num_samples == len(ran)
    assert budget.cost.ready
    coef = budget.cost.coefficients()
    assert coef is not None and all(c >= 0 for c in coef) and sum(coef) > 0
