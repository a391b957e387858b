"""Sampler: greedy, temperature, top-k/top-p/min-p support, penalties, seeds, logprobs, dtypes."""
import math

import pytest
import torch

from contract.sampling_params import SamplingParams
from runtime.execution.sampler import Sampler, SamplingRow, apply_penalties, filtered_probs

# probabilities that are exact in binary, so support boundaries are far from rounding
DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
DYADIC_LOGITS = DYADIC.log()


def row(params=None, generator=None, prompt=(), output=()) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), generator, list(prompt), list(output))


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def support(params: SamplingParams, logits: torch.Tensor, n: int = 4000) -> set[int]:
    """Tokens drawn from `n` copies of one row in a single batch."""
    result = Sampler(seed=1)(logits.repeat(n, 1), [row(params)] * n)
    return set(result.token_ids)


# ---- greedy ---------------------------------------------------------------------------------
def test_greedy_batch_is_argmax_and_draws_no_randomness():
    logits = torch.randn(6, 50, generator=seeded(0))
    sampler = Sampler(seed=3)
    before = sampler.generator.get_state()
    result = sampler(logits, [row(SamplingParams(temperature=0.0))] * 6)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 6 and result.top_logprobs == [None] * 6
    assert torch.equal(sampler.generator.get_state(), before)


def test_greedy_rows_stay_argmax_inside_a_sampled_batch():
    logits = torch.randn(4, 30, generator=seeded(1))
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.5)),
            row(SamplingParams(temperature=0.0)), row(SamplingParams(top_k=3))]
    tokens = Sampler()(logits, rows).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


# ---- temperature ----------------------------------------------------------------------------
def chi_square(tokens: list[int], expected_probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=len(expected_probs)).double()
    expected = expected_probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def test_temperature_samples_follow_the_scaled_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    n, temperature = 20000, 0.7
    params = SamplingParams(temperature=temperature)
    tokens = Sampler(seed=5)(logits.repeat(n, 1), [row(params)] * n).token_ids
    # df = 4: the 99.99th percentile is about 23.5; the wrong temperature is far beyond it
    assert chi_square(tokens, torch.softmax(logits / temperature, -1)) < 23.5
    assert chi_square(tokens, torch.softmax(logits, -1)) > 200


# ---- top-k / top-p / min-p ------------------------------------------------------------------
def test_top_k_restricts_support_exactly():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 1.9, -0.2, 0.1])
    assert support(SamplingParams(top_k=3), logits) == {1, 3, 5}
    assert support(SamplingParams(top_k=100), logits) == set(range(8))  # k > V: no filter


@pytest.mark.parametrize("top_p, kept", [(0.45, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}),
                                         (0.9, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_minimal_nucleus(top_p, kept):
    # at 0.9 the nucleus ends inside the tie at 0.0625: both tied tokens are kept
    params = SamplingParams(top_p=top_p)
    probs = filtered_probs(DYADIC_LOGITS.unsqueeze(0), [params])[0]
    assert set(probs.nonzero().flatten().tolist()) == kept
    assert support(params, DYADIC_LOGITS) == kept


def test_top_k_keeps_ties_at_the_boundary_and_mixes_with_unfiltered_rows():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]] * 2)
    probs = filtered_probs(logits, [SamplingParams(top_k=2), SamplingParams()])
    assert probs[0].nonzero().flatten().tolist() == [0, 2, 3]
    assert torch.equal(probs[1], torch.softmax(logits[1], -1))


def test_top_p_applies_to_the_top_k_renormalised_mass():
    # top-2 renormalised is [2/3, 1/3]: 0.6 of it is reached by token 0 alone
    params = SamplingParams(top_k=2, top_p=0.6)
    assert support(params, DYADIC_LOGITS) == {0}


@pytest.mark.parametrize("min_p, kept", [(0.3, {0, 1}), (0.2, {0, 1, 2}), (1.0, {0})])
def test_min_p_is_relative_to_the_top_probability(min_p, kept):
    params = SamplingParams(min_p=min_p)
    probs = filtered_probs(DYADIC_LOGITS.unsqueeze(0), [params])[0]
    assert set(probs.nonzero().flatten().tolist()) == kept
    assert support(params, DYADIC_LOGITS) == kept


def test_filters_are_exact_no_ops_for_rows_that_do_not_use_them():
    logits = torch.randn(3, 40, generator=seeded(2))
    plain = SamplingParams(temperature=0.8)
    alone = filtered_probs(logits[:1], [plain])
    mixed = filtered_probs(logits, [plain, SamplingParams(top_k=5, top_p=0.5),
                                    SamplingParams(min_p=0.1)])
    assert torch.equal(alone[0], mixed[0])


def test_top_k_mask_is_the_same_on_the_top_k_and_the_sort_paths():
    logits = torch.randn(2, 40, generator=seeded(6)).to(torch.bfloat16).float()  # bf16 ties
    top_k = SamplingParams(top_k=7)
    via_topk = filtered_probs(logits[:1], [top_k])
    via_sort = filtered_probs(logits, [top_k, SamplingParams(top_p=0.5)])
    assert torch.equal(via_topk[0], via_sort[0])


# ---- penalties ------------------------------------------------------------------------------
def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [row(params, prompt=[0], output=[1, 2, 2])])
    # 0: prompt only, repetition only: 2/2.   1: -2*2 - 0.5 - 0.25.   2: 1/2 - 0.5 - 2*0.25
    assert out.tolist() == [[1.0, -4.75, -0.5, 0.5, -1.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5, -1.0]]  # input untouched


def test_penalties_steer_greedy_but_logprobs_stay_raw():
    logits = torch.tensor([[1.0, 1.5, -3.0], [1.0, 1.5, -3.0]])
    rows = [row(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=True), output=[1]),
            row(SamplingParams(temperature=0.0, logprobs=True), output=[1])]
    result = Sampler()(logits, rows)
    assert result.token_ids == [0, 1]  # the unpenalised neighbour is unaffected
    raw = torch.log_softmax(logits[0], -1)
    assert result.logprobs[0] == pytest.approx(raw[0].item(), abs=1e-6)


# ---- seeds ----------------------------------------------------------------------------------
def run_seeded(batches: list[tuple[list[SamplingRow], int]], logits_row: torch.Tensor,
               sampler_seed: int, steps: int = 6) -> list[int]:
    """Sample `steps` tokens for the seeded row; each step uses the batch picked in rotation."""
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=7)
    g = seeded(7)
    sampler = Sampler(seed=sampler_seed)
    tokens = []
    for step in range(steps):
        others, position = batches[step % len(batches)]
        rows = others[:position] + [row(target, g)] + others[position:]
        logits = torch.randn(len(rows), logits_row.shape[0], generator=seeded(100 + step))
        logits[position] = logits_row
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_its_batch():
    logits_row = torch.randn(64, generator=seeded(3)) * 0.5  # flat enough that draws vary
    alone = run_seeded([([], 0)], logits_row, sampler_seed=0)
    others = [row(), row(SamplingParams(temperature=0.0)), row(SamplingParams(top_k=4), seeded(1)),
              row(SamplingParams(min_p=0.2, repetition_penalty=1.3), prompt=[1, 2], output=[3])]
    batched = run_seeded([(others, 2), (others[::-1], 0), (others[:1], 1), (others, 4)],
                         logits_row, sampler_seed=99)
    assert alone == batched
    assert len(set(alone)) > 1  # the draws really vary from step to step


def test_seeded_row_uses_one_uniform_vector_per_step():
    g, reference = seeded(11), seeded(11)
    Sampler()(torch.zeros(2, 17), [row(SamplingParams(seed=11), g), row()])
    torch.empty(17).uniform_(generator=reference)
    assert torch.equal(g.get_state(), reference.get_state())


# ---- logprobs and dtypes --------------------------------------------------------------------
def test_logprobs_and_top_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, 25, generator=seeded(4))
    rows = [row(SamplingParams(temperature=0.5, top_k=2, logprobs=True, top_logprobs=5,
                               frequency_penalty=1.0), output=[0, 0]),
            row(SamplingParams()),
            row(SamplingParams(temperature=0.0, top_logprobs=3))]
    result = Sampler(seed=2)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i in (0, 2):
        assert result.logprobs[i] == pytest.approx(raw[i, result.token_ids[i]].item(), abs=1e-6)
        top = result.top_logprobs[i]
        assert len(top) == rows[i].params.top_logprobs
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        expected_vals, expected_ids = raw[i].topk(len(top))
        assert [t for t, _ in top] == expected_ids.tolist()
        assert values == pytest.approx(expected_vals.tolist(), abs=1e-6)
    assert result.logprobs[1] is None and result.top_logprobs[1] is None


def test_logprobs_without_top_logprobs():
    result = Sampler()(torch.tensor([[0.0, math.log(3.0)]]),
                       [row(SamplingParams(temperature=0.0, logprobs=True))])
    assert result.token_ids == [1]
    assert result.logprobs == [pytest.approx(math.log(0.75), abs=1e-6)]
    assert result.top_logprobs == [None]


def test_bfloat16_logits_are_accepted():
    logits = torch.randn(4, 33, generator=seeded(5)).to(torch.bfloat16)
    rows = [row(SamplingParams(temperature=0.0, logprobs=True)), row(SamplingParams(top_p=0.9)),
            row(SamplingParams(seed=1), seeded(1)), row(SamplingParams(repetition_penalty=1.2),
                                                       prompt=[3])]
    result = Sampler()(logits, rows)
    assert result.token_ids[0] == logits.float()[0].argmax()
    assert all(0 <= t < 33 for t in result.token_ids)
    raw = torch.log_softmax(logits.float()[0], -1)
    assert result.logprobs[0] == pytest.approx(raw[result.token_ids[0]].item(), abs=1e-6)


def test_logits_must_match_rows():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [row()])
