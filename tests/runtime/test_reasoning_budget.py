"""The reasoning budget on the real engine (the tiny random model, CPU): once the output has
thought `reasoning_budget` tokens inside an open think block, the engine appends the end
marker's tokens itself, then generation goes on; without a budget, or without a think block,
nothing is forced."""
from __future__ import annotations

import pytest

from contract.errors import InvalidRequestError
from contract.sampling_params import SamplingParams
from runtime.structured.reasoning import ThinkBudget

END = "</think>"


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                             **fields})


def test_budget_forces_the_end_marker_then_generation_goes_on(make_tiny_engine):
    engine = make_tiny_engine()
    tok = engine.tokenizer
    end_ids = tok.encode(END)
    prompt = tok.encode("User: why is the sky blue?\nAssistant: <think>\n")
    free = engine.generate([prompt], greedy())[0]
    assert END not in tok.decode(free, skip_special_tokens=False)  # the model never closes
    for budget in (0, 1, 5):
        out = engine.generate([prompt], greedy(reasoning_budget=budget))[0]
        assert out[:budget] == free[:budget]  # the thinking as sampled...
        assert out[budget:budget + len(end_ids)] == end_ids  # ...then the marker, forced
        assert len(out) == 24  # and the answer goes on to max_tokens
        assert tok.decode(out, skip_special_tokens=False).count(END) >= 1


def test_no_open_block_or_no_budget_forces_nothing(make_tiny_engine):
    engine = make_tiny_engine()
    tok = engine.tokenizer
    plain = tok.encode("User: why is the sky blue?\nAssistant:")
    free = engine.generate([plain], greedy())[0]
    assert engine.generate([plain], greedy(reasoning_budget=0))[0] == free
    opened = tok.encode("User: hi\nAssistant: <think>\n")
    assert engine.generate([opened], greedy(reasoning_budget=None))[0] == \
        engine.generate([opened], greedy())[0]


def test_a_block_the_output_opens_is_budgeted_from_its_start():
    fed = []
    budget = ThinkBudget(2, [90, 91], lambda t: {1: b"<thi", 2: b"nk>", 3: b"x",
                                                  90: b"</thi", 91: b"nk>"}[t], [3, 3])
    assert not budget.inside
    for token in (3, 1, 2, 3):
        budget.accept(token)
        fed.append(budget.forced_tokens(10))
    assert budget.inside and fed == [[], [], [], []] and budget.used == 1
    budget.accept(3)
    assert budget.forced_tokens(1) == [90]  # as much as fits
    budget.accept(90)
    budget.accept(91)
    assert budget.done and not budget.active and budget.forced_tokens(10) == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(reasoning_budget=bad)
    assert info.value.param == "max_reasoning_tokens"


def test_a_grammar_waits_for_the_thought_then_holds_the_answer(make_tiny_engine):
    engine = make_tiny_engine()
    tok = engine.tokenizer
    end_ids = tok.encode(END)
    choice = {"type": "choice", "choices": ["Paris", "Rome"]}
    opened = tok.encode("User: capital of France?\nAssistant: <think>\n")
    out = engine.generate([opened], greedy(structured=choice, reasoning_budget=4))[0]
    assert out[4:4 + len(end_ids)] == end_ids  # four free tokens of thought, then the end
    answer = tok.decode(out[4 + len(end_ids):], skip_special_tokens=True)
    assert answer in ("Paris", "Rome")  # the grammar held the answer, and ended it
    assert len(out) < 24
    plain = tok.encode("User: capital of France?\nAssistant:")
    direct = engine.generate([plain], greedy(structured=choice, reasoning_budget=4))[0]
    assert tok.decode(direct, skip_special_tokens=True) in ("Paris", "Rome")  # no block
