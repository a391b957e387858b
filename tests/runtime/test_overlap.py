"""Overlapped steps (runtime/execution/overlap.py) change no output: the same requests give the same
tokens, text, logprobs, finish reasons and usage with overlap on and off, through admission
mid-flight, stops of every kind, preemption, aborts and prefix-cache hits; nothing leaks; and
steps that need their last token on the host fall back to running in order."""
from __future__ import annotations

import pytest

from contract.outputs import StepSample
from contract.sampling_params import SamplingParams
from runtime.execution.overlap import PendingStep, overlap_enabled, placeholder_fill
from runtime.scheduling.output import ScheduledRequest
from runtime.scheduling.request import PLACEHOLDER
from tests.runtime.structured_helpers import SPECS, assert_clean


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})


def prompts(engine) -> list[list[int]]:
    text = ["The quick brown fox", "Paris is the capital of", "Numbers: 1 2 3 4 5",
            "Once upon a time there was", "The quick brown fox jumps over", "a b c d e f g h"]
    return [engine.tokenizer.encode(t) for t in text]


def drive(engine, jobs: list[tuple[str, list[int], SamplingParams]], abort_at: dict | None = None,
          add_later: int = 2) -> dict:
    """Add the first jobs, the rest a few steps in (they join a running batch); abort some
    after a number of steps; record each request's outputs until everything ends."""
    abort_at = dict(abort_at or {})
    seen: dict[str, list] = {rid: [] for rid, _, _ in jobs}
    waiting = list(jobs)
    step = 0
    while waiting or engine.has_unfinished_requests():
        if waiting and (step == 0 or step % add_later == 0):
            for rid, prompt, params in waiting[:2]:
                engine.add_request(rid, prompt, params)
            waiting = waiting[2:]
        for rid, at in list(abort_at.items()):
            if step == at:
                out = engine.abort_request(rid)
                if out is not None:
                    seen[rid].append(out)
                del abort_at[rid]
        for out in engine.step()[0]:
            seen[out.request_id].append(out)
        step += 1
        assert step < 500
    return {rid: summary(outs) for rid, outs in seen.items()}


def summary(outs: list) -> dict:
    final = outs[-1]
    return {"tokens": [t for o in outs for t in o.new_token_ids],
            "text": "".join(o.new_text for o in outs),
            "logprobs": [lp for o in outs for lp in (o.logprobs or [])],
            "prompt_logprobs": [o.prompt_logprobs for o in outs if o.prompt_logprobs],
            "finish": final.finish_reason, "stop_reason": final.stop_reason,
            "usage": final.usage, "finished": [o.finished for o in outs].count(True)}


def assert_same(on: dict, off: dict) -> None:
    """Tokens, text, finishes and usage exactly; logprobs to float32 rounding (a request that
    ended rides one more step with overlap, so some batches differ in size, and a matmul's
    sums with them)."""
    assert on.keys() == off.keys()
    for rid in off:
        a, b = dict(on[rid]), dict(off[rid])
        for key in ("logprobs", "prompt_logprobs"):
            assert flat(a.pop(key)) == pytest.approx(flat(b.pop(key)), abs=1e-4), (rid, key)
        assert a == b, rid


def flat(value) -> list:
    """Every number in nested logprob records, in order (token ids and ranks included)."""
    if isinstance(value, (int, float)):
        return [value]
    if value is None:
        return [None]
    if hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    return [x for item in value for x in flat(item)]


def both(make, jobs, abort_at=None, **cfg) -> tuple[dict, dict, object]:
    results = []
    for mode in ("off", "on"):
        engine = make(overlap=mode, **cfg)
        results.append(drive(engine, jobs, abort_at))
        assert_clean(engine)
    return results[0], results[1], engine


def test_auto_overlaps_on_cuda_only():
    import torch
    assert overlap_enabled("auto", torch.device("cuda")) is True
    assert overlap_enabled("auto", torch.device("cpu")) is False
    assert overlap_enabled("on", torch.device("cpu")) is True
    with pytest.raises(ValueError, match="overlap must be one of"):
        overlap_enabled("sometimes", torch.device("cpu"))


def test_same_outputs_with_overlap_through_stops_logprobs_and_admission(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(engine)
    first = engine.generate([p[0]], greedy(max_tokens=6))[0]
    text = engine.tokenizer.decode(first[2:4])
    jobs = [("plain", p[0], greedy()),
            ("short", p[1], greedy(max_tokens=1)),
            ("stop-token", p[0], greedy(stop_token_ids=(first[3],))),
            ("stop-string", p[0], greedy(stop=[text]) if text.strip() else greedy()),
            ("logprobs", p[2], greedy(logprobs=True, top_logprobs=3)),
            ("prompt-lp", p[3], greedy(max_tokens=4, prompt_logprobs=2)),
            ("seeded", p[4], SamplingParams(max_tokens=10, temperature=0.9, seed=7)),
            ("same-prefix", p[4], greedy(max_tokens=8)),
            ("long", p[5], greedy(max_tokens=30, ignore_eos=True))]
    off, on, overlapped = both(make_tiny_engine, jobs)
    assert_same(on, off)
    assert off["stop-token"]["finish"] == "stop" and off["stop-token"]["stop_reason"] == first[3]
    assert off["short"]["usage"].completion_tokens == 1
    assert all(r["finished"] == 1 for r in on.values())
    assert overlapped.counters.overlapped_steps > 10  # it did overlap


def test_same_outputs_under_preemption_and_aborts(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(engine)
    jobs = [(f"r{i}", p[i % len(p)], greedy(max_tokens=20 + i, ignore_eos=True))
            for i in range(8)]
    # 24 blocks of 4 tokens cannot hold eight growing requests: some are preempted
    off, on, overlapped = both(make_tiny_engine, jobs, abort_at={"r2": 5, "r5": 9},
                               num_blocks=24)
    # an abort at the same step finds one token fewer read back with overlap (the one in
    # flight is dropped): what it delivered is a prefix of the in-order run, and billed as such
    for rid in ("r2", "r5"):
        a, b = on.pop(rid), off.pop(rid)
        assert a["finish"] == b["finish"] == "abort"
        assert a["tokens"] == b["tokens"][:len(a["tokens"])]
        assert a["usage"].completion_tokens == len(a["tokens"])
    assert_same(on, off)
    assert on["r0"]["finish"] == "length"
    assert overlapped.counters.num_preemptions > 0


def test_max_model_len_ends_in_flight_without_planning_past_it(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(engine)[0]
    jobs = [("edge", prompt, greedy(max_tokens=5, ignore_eos=True))]  # the whole room left
    off, on, _ = both(make_tiny_engine, jobs, max_model_len=len(prompt) + 5)
    assert_same(on, off)
    assert on["edge"]["finish"] == "length"
    assert len(on["edge"]["tokens"]) == 5


def test_grammars_penalties_and_speculation_run_in_order(make_tiny_engine):
    engine = make_tiny_engine(overlap="on")
    p = prompts(engine)
    engine.add_request("free", p[0], greedy(max_tokens=6))
    engine.add_request("penalised", p[1], greedy(max_tokens=6, repetition_penalty=1.3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.overlapped_steps == 0
    structured = SamplingParams(max_tokens=30, temperature=0.0,
                                structured=SPECS["regex"])
    engine.add_request("json", p[2], structured)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.overlapped_steps == 0
    assert_clean(engine)
    spec = make_tiny_engine(overlap="on", spec="ngram")
    assert spec.generate([p[5]], greedy(max_tokens=10)) == \
        make_tiny_engine(overlap="off", spec="ngram").generate([p[5]], greedy(max_tokens=10))
    assert spec.counters.overlapped_steps == 0


def test_a_grammar_arriving_mid_flight_reads_the_step_back_first(make_tiny_engine):
    jobs_out = []
    for mode in ("off", "on"):
        engine = make_tiny_engine(overlap=mode)
        p = prompts(engine)
        engine.add_request("free", p[0], greedy(max_tokens=16, ignore_eos=True))
        outs = {"free": [], "c": []}
        for step in range(200):
            if step == 3:
                engine.add_request("c", p[2], SamplingParams(
                    max_tokens=20, temperature=0.0, structured=SPECS["regex"]))
            for o in engine.step()[0]:
                outs[o.request_id].append(o)
            if step > 3 and not engine.has_unfinished_requests():
                break
        jobs_out.append({k: summary(v) for k, v in outs.items()})
        assert_clean(engine)
    assert_same(jobs_out[1], jobs_out[0])


def test_placeholders_are_filled_from_the_previous_steps_tokens():
    import torch
    previous = PendingStep(rows={"a": 0, "b": 1}, partial=StepSample())

    class Sample:
        tokens = torch.tensor([11, 22])
    previous.sample = Sample()
    batch = [ScheduledRequest("b", 5, (PLACEHOLDER,), (0, 1)),
             ScheduledRequest("c", 0, (7, 8, 9), (2,)),
             ScheduledRequest("a", 3, (PLACEHOLDER,), (3,))]
    ids = torch.tensor([PLACEHOLDER, PLACEHOLDER, 7, 8, 9])
    fill = placeholder_fill(batch, {"b": 0, "a": 1, "c": 4}, previous, torch.device("cpu"))
    fill(ids)
    assert ids.tolist() == [22, 11, 7, 8, 9]
    assert placeholder_fill(batch[1:2], {"c": 2}, previous, torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="did not sample"):
        placeholder_fill([ScheduledRequest("z", 0, (PLACEHOLDER,), (0,))], {"z": 0},
                         previous, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="did not sample"):  # only ever the last token
        placeholder_fill([ScheduledRequest("a", 0, (PLACEHOLDER, 4), (0,))], {"a": 1},
                         previous, torch.device("cpu"))
