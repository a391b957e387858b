"""End to end on the tiny random model: batching, chunking and preemption never change output."""
import pytest

from contract.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from contract.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(tok):
    texts = ["The quick brown fox", "Paris is the capital of",
             "def add(a, b):\n    return", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 and prices",
             "Caching the prefix of a prompt saves compute for every request that repeats it."]
    return [tok.encode(t) for t in texts]


def run_alone(engine, ps, params):
    return [engine.generate([p], params)[0] for p in ps]


def assert_idle_and_clean(engine):
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.requests == {}


def test_batched_greedy_equals_one_at_a_time(make_tiny_engine):
    engine = make_tiny_engine()
    ps = prompts(engine.tokenizer)
    alone = run_alone(engine, ps, GREEDY)
    together = engine.generate(ps, GREEDY)
    assert together == alone
    assert all(len(o) == 12 for o in alone)
    assert_idle_and_clean(engine)


def test_chunked_prefill_equals_unchunked(make_tiny_engine):
    big = make_tiny_engine(max_num_batched_tokens=256)
    small = make_tiny_engine(max_num_batched_tokens=5)  # every prompt is cut into chunks
    ps = prompts(big.tokenizer)
    assert small.generate(ps, GREEDY) == big.generate(ps, GREEDY)


def test_preempted_and_recomputed_equals_uninterrupted(make_tiny_engine):
    roomy = make_tiny_engine(num_blocks=64)
    tight = make_tiny_engine(num_blocks=14)  # 56 slots for 5 growing requests: preemption
    ps = prompts(roomy.tokenizer)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = roomy.generate(ps, params)
    got = tight.generate(ps, params)
    assert tight.counters.num_preemptions > 0
    assert got == expected
    assert_idle_and_clean(tight)


def test_seeded_sampling_is_reproducible_in_different_batch_mixes(make_tiny_engine):
    engine = make_tiny_engine()
    ps = prompts(engine.tokenizer)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    noise = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    alone = engine.generate([ps[1]], seeded)[0]
    mixed = engine.generate([ps[0], ps[1], ps[2]], [noise, seeded, noise])[1]
    reordered = engine.generate([ps[3], ps[4], ps[1]], [noise, noise, seeded])[2]
    assert alone == mixed == reordered
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99,
                                ignore_eos=True)
    assert engine.generate([ps[1]], other_seed)[0] != alone


def test_usage_finish_reasons_and_logprobs(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(engine.tokenizer)[0]
    engine.add_request("a", p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                              logprobs=True, top_logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()[0]
    assert [o.finished for o in outs] == [False, False, True]
    last = outs[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(p), 3)
    for o in outs:
        lp = o.logprobs[0]
        assert lp.token_id == o.new_token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


def test_stop_token_id_ends_with_stop(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(engine.tokenizer)[1]
    first = engine.generate([p], GREEDY)[0]
    stop_at = first[3]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(stop_at,))
    engine.add_request("s", p, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            final = o
    assert final.finish_reason == "stop" and final.stop_reason == stop_at
    assert final.usage.completion_tokens == first.index(stop_at) + 1


def test_stop_string_cuts_the_text(make_tiny_engine):
    engine = make_tiny_engine()
    tok = engine.tokenizer
    p = prompts(tok)[2]
    full = tok.decode(engine.generate([p], GREEDY)[0])
    stop = full[3:6]
    assert stop
    engine.add_request("s", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                              stop=(stop,)))
    text, final = "", None
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            text += o.new_text
            final = o
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert text == full[:full.index(stop)]


def test_abort_frees_everything(make_tiny_engine):
    engine = make_tiny_engine()
    ps = prompts(engine.tokenizer)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    final = engine.abort_request("r1")
    assert final.finished and final.finish_reason == "abort"
    assert final.usage.completion_tokens >= 1
    assert engine.abort_request("r1") is None
    for i in (0, 2, 3, 4):
        engine.abort_request(f"r{i}")
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("prompt, params, error, param", [
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, 10**6], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, -1], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, "x"], SamplingParams(), InvalidRequestError, "prompt"),
    ([1] * 512, SamplingParams(), PromptTooLongError, "prompt"),
    ([1] * 10, SamplingParams(max_tokens=600), PromptTooLongError, "max_tokens"),
])
def test_bad_input_is_rejected_and_leaves_state_alone(make_tiny_engine, prompt, params,
                                                      error, param):
    engine = make_tiny_engine()
    engine.add_request("ok", [1, 2, 3], GREEDY)
    engine.step()
    before = (engine.kv.pool.free_queue.block_ids(), len(engine.scheduler.waiting),
              list(engine.scheduler.running), dict(engine.requests))
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == param
    after = (engine.kv.pool.free_queue.block_ids(), len(engine.scheduler.waiting),
             list(engine.scheduler.running), dict(engine.requests))
    assert before == after


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(top_logprobs=99), "top_logprobs"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_duplicate_id_and_bad_salt(make_tiny_engine):
    engine = make_tiny_engine()
    engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("b", [1, 2], GREEDY, cache_salt=123)
    with pytest.raises(InvalidRequestError):
        engine.add_request("b", [1, 2], GREEDY, cache_salt="x" * 2000)
    assert list(engine.requests) == ["a"]


def test_step_stats_report_budget_and_blocks(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=8)
    engine.add_request("a", list(range(3, 23)), GREEDY)  # 20 prompt tokens, 8 per step
    _, stats = engine.step()
    assert (stats.num_prefill_tokens, stats.num_decode_tokens) == (8, 0)
    assert stats.kv_blocks_used == 2 and stats.kv_blocks_total == 64
    assert stats.num_running == 1 and stats.seconds_busy > 0
