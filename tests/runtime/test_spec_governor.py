"""The speculation governor on scripted step costs: it speculates where the measured time per
token wins and stops where verification costs more than acceptance yields; probes and plain
refresh steps stay bounded."""
import random
from types import SimpleNamespace

import pytest

from contract.sampling_params import SamplingParams
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.spec_decode import governor as gov_module
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.governor import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    REFRESH_EVERY,
    Governor,
    SpecState,
)
from runtime.spec_decode.step_times import StepTimes, decode_step_key

PLAIN_S = 0.010  # a plain one-stream decode step of the scripted machine


def request(**params):
    return SimpleNamespace(params=SamplingParams(temperature=0.0, **params), grammar=None,
                           think=None, spec=SpecState())


def step(rid_k: list[tuple[str, int]], position: int = 100) -> SchedulerOutput:
    return SchedulerOutput(tuple(
        ScheduledRequest(rid, position, (1,), (0,), k, (2,) * k, samples=True)
        for rid, k in rid_k))


def simulate(governor, cost, acceptance, steps, batch=1, seed=0):
    """Run `steps` planned steps on a machine whose step of `rows` rows for `batch` requests
    takes cost(batch, rows) seconds; each proposal is accepted with probability
    `acceptance(step)` until the first rejection. Returns (tokens per second over plain
    decoding's, speculating request-steps, the requests, per-step proposal totals)."""
    rng = random.Random(seed)
    reqs = [request() for _ in range(batch)]
    tokens = seconds = plain_seconds = 0.0
    spec_steps, proposed = 0, []
    for i in range(steps):
        ks = [governor.num_tokens(r) for r in reqs] if governor.step_allows(batch) \
            else [0] * batch
        rows = batch + sum(ks)
        s = cost(batch, rows, i)
        governor.observe_step(step([(f"r{j}", k) for j, k in enumerate(ks)], 100 + i), s)
        for r, k in zip(reqs, ks):
            accepted = 0
            while accepted < k and rng.random() < acceptance(i):
                accepted += 1
            if k:
                Governor.record(r.spec, k, accepted)
                spec_steps += 1
            tokens += accepted + 1
        seconds += s
        plain_seconds += cost(batch, batch, i)
        proposed.append(sum(ks))
    plain_tokens = steps * batch
    return (tokens / seconds) / (plain_tokens / plain_seconds), spec_steps, reqs, proposed


def ngram_governor(**kw):
    return Governor(SpecConfig("ngram", num_tokens=4, max_batch=4, **kw))


def costly_verify(batch, rows, i):
    """A verification step that leaves the fast path: 1.6x a plain step and more per row."""
    return PLAIN_S * batch if rows == batch else PLAIN_S * batch * (1.6 + 0.05 * (rows - batch))


def cheap_verify(batch, rows, i):
    """A bandwidth-bound step: each verified row adds 2% of a plain step."""
    return PLAIN_S * batch * (1 + 0.02 * (rows - batch))


def test_stops_where_verification_costs_more_than_acceptance_yields():
    governor = ngram_governor()
    ratio, spec_steps, reqs, _ = simulate(governor, costly_verify, lambda i: 0.3, 3000)
    # exploration: each shape's two timed steps, then probes at the budget's interval
    assert spec_steps <= 4 * 2 + 3000 // 65
    assert ratio >= 0.98
    # a probe's measured cost sets its interval: (1.65 - 1) / 1% = 65 steps
    assert reqs[0].spec.probe_every == 65


def test_speculates_the_longest_draft_where_it_pays():
    governor = ngram_governor()
    ratio, spec_steps, _, proposed = simulate(governor, cheap_verify, lambda i: 0.85, 1000)
    assert ratio >= 2.0
    assert spec_steps >= 1000 * (1 - 2 / REFRESH_EVERY)
    assert proposed[-200:].count(4) >= 150


def test_one_stream_on_chat_like_acceptance_turns_on():
    """Low acceptance (0.35 per token, as on free chat) still pays when a verify step costs
    little more than a decode step."""
    governor = ngram_governor()
    ratio, spec_steps, _, _ = simulate(governor, cheap_verify, lambda i: 0.35, 1000)
    assert ratio >= 1.2 and spec_steps >= 900


def test_follows_a_machine_whose_verification_becomes_costly():
    governor = ngram_governor()
    cost = lambda b, rows, i: cheap_verify(b, rows, i) if i < 500 else costly_verify(b, rows, i)  # noqa: E731
    _, _, _, proposed = simulate(governor, cost, lambda i: 0.3, 1500)
    assert sum(proposed[:500]) > 400 * 2
    late = proposed[600:]  # after the window of old cheap timings has turned over
    assert sum(1 for k in late if k) <= len(late) // PROBE_EVERY + 1


def test_paused_requests_probe_rarely_and_resume_when_acceptance_returns():
    governor = ngram_governor()
    acceptance = lambda i: 0.0 if i < 2000 else 0.95  # noqa: E731
    _, _, reqs, proposed = simulate(governor, cheap_verify, acceptance, 3000)
    assert sum(1 for k in proposed[200:2000] if k) <= 1800 // PROBE_EVERY + 1
    assert reqs[0].spec.num_probes <= 3000 // PROBE_EVERY
    assert sum(1 for k in proposed[-200:] if k) >= 150  # a probe found it paying again


def test_probe_interval_is_capped():
    governor = ngram_governor()
    awful = lambda b, rows, i: PLAIN_S * (1 if rows == b else 20)  # noqa: E731
    ratio, spec_steps, reqs, _ = simulate(governor, awful, lambda i: 0.0, 3000)
    assert reqs[0].spec.probe_every == MAX_PROBE_EVERY
    assert spec_steps <= 4 * 2 + 3000 // MAX_PROBE_EVERY + 1


def test_batches_weigh_the_whole_step():
    """Four streams: one request's proposals slow the other three too."""
    governor = ngram_governor()
    # each extra row costs 30% of the 4-stream step: no acceptance rate pays for it at 0.5
    cost = lambda b, rows, i: PLAIN_S * b * (1 + 0.3 * (rows - b))  # noqa: E731
    ratio, spec_steps, _, _ = simulate(governor, cost, lambda i: 0.5, 2000, batch=4)
    assert ratio >= 0.97 and spec_steps <= 4 * (8 + 2000 // PROBE_EVERY)


def test_plain_steps_timed_twice_and_large_batches_never_speculate():
    governor = ngram_governor()
    r = request()
    assert governor.step_allows(1) and governor.num_tokens(r) == 4  # the prior: try
    governor.observe_step(step([("a", 4)]), PLAIN_S)
    governor.observe_step(step([("a", 0)]), PLAIN_S)  # one plain step timed ...
    assert governor.step_allows(1) and governor.num_tokens(r) == 0  # ... the second follows
    assert r.spec.num_paused_steps == 0  # a timed plain step is not a pause
    assert not governor.step_allows(5)  # above max_batch
    for opt_out in ({"speculative": False}, {"logprobs": 2}):
        governor.observe_step(step([("a", 0)]), PLAIN_S)
        governor.observe_step(step([("a", 0)]), PLAIN_S)
        assert governor.step_allows(1) and governor.num_tokens(request(**opt_out)) == 0


def test_prior_keeps_the_drafters_relative_cost():
    free = Governor(SpecConfig("ngram", num_tokens=4), draft_cost=0.0)
    costly = Governor(SpecConfig("self", num_layers=24, num_tokens=4), draft_cost=0.8)
    assert free.best_k(0.9)[0] == 4
    assert costly.best_k(0.22)[0] == 0
    assert free.best_k(0.0)[0] == 0


def test_model_drafter_steps_are_keyed_by_draft_depth():
    out = step([("a", 3), ("b", 1)])
    assert decode_step_key(out, model_drafter=True) == (2, 6, 3)
    assert decode_step_key(out, model_drafter=False) == (2, 6, 0)
    prefill = SchedulerOutput((ScheduledRequest("a", 0, (1, 2, 3), (0,)),))
    assert decode_step_key(prefill, model_drafter=False) is None
    assert decode_step_key(SchedulerOutput(), model_drafter=False) is None


def test_step_times_median_ignores_one_slow_step():
    times = StepTimes(window=5, min_samples=2)
    key = (1, 1, 0)
    times.observe(key, 0.01)
    assert times.seconds(key) is None
    for s in (0.01, 0.5, 0.011, 0.0):  # a stalled step; a zero time teaches nothing
        times.observe(key, s)
    assert times.seconds(key) == pytest.approx(0.0105)
    assert times.count(key) == 4
    with pytest.raises(ValueError):
        StepTimes(window=1, min_samples=2)


def test_module_constants_are_consistent():
    assert 1.0 < gov_module.MIN_GAIN < 1.2 and PROBE_EVERY <= MAX_PROBE_EVERY


def test_record_counts_the_judged_proposals_and_keeps_totals():
    state = SpecState()
    Governor.record(state, 4, 1)  # one accepted, the second rejected, two never compared
    Governor.record(state, 0, 0)  # nothing proposed: nothing learnt
    assert (state.num_proposed, state.num_accepted) == (4, 1)
    assert state.rate == pytest.approx((0.9 + 1) / (0.9 + 2))
    for _ in range(60):
        Governor.record(state, 4, 4)
    assert state.rate > 0.99


def test_a_new_request_risks_one_row_first_once_costs_are_known():
    governor = ngram_governor()
    for extra in (0, 0, 4, 4, 1, 1):
        governor.observe_step(step([("a", extra)]), PLAIN_S * (1 + 0.02 * extra))
    fresh, known = request(), request()
    Governor.record(known.spec, 4, 4)
    assert governor.step_allows(1)
    assert governor.num_tokens(fresh) == 1
    assert governor.step_allows(1)
    assert governor.num_tokens(known) == 4
