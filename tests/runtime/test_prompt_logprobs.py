"""prompt_logprobs (vLLM's): every prompt token scored by a full-sequence forward, whatever the
chunking, batching, prefix cache, preemption, speculation or disaggregation; delivered once."""
from __future__ import annotations

import orjson
import pytest
import torch

from contract.errors import InvalidRequestError
from contract.frames import ProtocolError, Step, decode_frame, encode_frame, frame_from_dict
from contract.outputs import MIN_LOGPROB
from contract.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from runtime.execution.sampler import score_tokens
from runtime.transport.worker import output_message

# float32 logprobs of one forward against another (batching changes the sums), through the
# default float16 KV cache, where a reordered sum may round a stored K or V one unit apart
# (measured on the tiny model, seeds 0-2, whole against chunked: up to 5e-6 with the float16
# cache, 1e-6 with float32; its logits are small, so a unit of float16 moves them little)
TOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Caching the prefix of a prompt saves compute for every request that repeats it.",
         "Paris is the capital of"]


def asking(k: int, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=k)


def reference(make_tiny_engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax over the prompt's logits from one forward of the whole prompt."""
    return torch.log_softmax(make_tiny_engine().prompt_logits(prompt), dim=-1)


def run(engine, requests: dict) -> dict[str, list]:
    """Add (prompt, params) per id, step to the end; every request's outputs in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            seen[out.request_id].append(out)
    return seen


def delivered(outs: list) -> list:
    """The prompt logprobs, checked to ride on the first output with tokens and no other."""
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    first_with_tokens = next(o for o in outs if o.new_token_ids)
    assert carrying == [first_with_tokens]
    return carrying[0].prompt_logprobs


def assert_idle_and_clean(engine) -> None:
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def assert_matches(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """Each entry against the reference row that predicts its token: logprob, a brute-force
    rank, and the top k (sorted, and the reference's best values)."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row = entries[i], ref[i - 1]
        assert e.token_id == prompt[i]
        target = row[prompt[i]].item()
        assert abs(e.logprob - target) < TOL
        # brute force: 1 + tokens strictly more likely, up to near-ties within tolerance
        assert 1 + int((row > target + TOL).sum()) <= e.rank <= 1 + int((row > target - TOL).sum())
        values = [lp for _, lp in e.top]
        assert len(e.top) == k and values == sorted(values, reverse=True)
        assert len({t for t, _ in e.top}) == k
        best = row.topk(k).values.tolist() if k else []
        assert all(abs(a - b) < TOL for a, b in zip(values, best))
        assert all(abs(row[t].item() - lp) < TOL for t, lp in e.top)


# ---- against a full-sequence forward ---------------------------------------------------------
@pytest.mark.parametrize("budget", [256, 5, 3], ids=["whole", "chunked-5", "chunked-3"])
def test_equal_a_full_sequence_forward(make_tiny_engine, budget):
    engine = make_tiny_engine(max_num_batched_tokens=budget)
    for j, text in enumerate(TEXTS):
        prompt = engine.tokenizer.encode(text)
        outs = run(engine, {f"r{j}": (prompt, asking(4))})[f"r{j}"]
        assert_matches(delivered(outs), prompt, reference(make_tiny_engine, prompt), 4)
        assert outs[-1].usage.cached_tokens == 0
    assert_idle_and_clean(engine)


def test_equal_transformers_on_the_same_checkpoint(make_tiny_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    # a float32 cache: the same arithmetic as transformers (float16 has its own test in
    # tests/runtime/test_vs_transformers.py)
    engine = make_tiny_engine(max_num_batched_tokens=7, kv_cache_dtype="float32")
    prompt = engine.tokenizer.encode(TEXTS[1])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert_matches(delivered(run(engine, {"r": (prompt, asking(2))})["r"]), prompt, ref, 2)


def test_zero_alternatives_and_a_one_token_prompt(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = engine.tokenizer.encode(TEXTS[0])
    seen = run(engine, {"zero": (prompt, asking(0)), "one": ([prompt[0]], asking(3))})
    assert_matches(delivered(seen["zero"]), prompt, reference(make_tiny_engine, prompt), 0)
    assert delivered(seen["one"]) == [None]


def test_logits_made_a_bounded_slice_of_rows_at_a_time(make_tiny_engine, monkeypatch):
    import runtime.execution.runner as model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 4)
    engine = make_tiny_engine(max_num_batched_tokens=256)
    rows: list[int] = []
    compute = engine.runner.model.compute_logits
    monkeypatch.setattr(engine.runner.model, "compute_logits",
                        lambda h: rows.append(h.shape[0]) or compute(h))
    prompt = engine.tokenizer.encode(TEXTS[1])
    entries = delivered(run(engine, {"r": (prompt, asking(3, max_tokens=1))})["r"])
    assert max(rows) <= 4 and sum(rows) == len(prompt)  # n - 1 scored, the last one samples
    assert_matches(entries, prompt, reference(make_tiny_engine, prompt), 3)


# ---- the prefix cache ------------------------------------------------------------------------
def test_warm_prefix_cache_is_not_read_but_is_written(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = engine.tokenizer.encode(TEXTS[1])
    ref = reference(make_tiny_engine, prompt)
    first = run(engine, {"asks": (prompt, asking(2))})["asks"]  # computes and caches blocks
    assert first[-1].usage.cached_tokens == 0
    plain = run(engine, {"plain": (prompt, SamplingParams(max_tokens=2))})["plain"]
    assert plain[-1].usage.cached_tokens > 0  # the cache is warm, from the asking request
    queries = engine.kv.stats.queries
    again = run(engine, {"again": (prompt, asking(2))})["again"]
    assert again[-1].usage.cached_tokens == 0 and engine.kv.stats.queries == queries
    assert_matches(delivered(again), prompt, ref, 2)
    assert_idle_and_clean(engine)


# ---- batching --------------------------------------------------------------------------------
def test_batched_with_others_and_duplicates(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=9)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    alone = {i: engine.generate([p], plain)[0] for i, p in enumerate(prompts)}
    seen = run(engine, {"p0": (prompts[0], plain), "a1": (prompts[1], asking(2, 5)),
                        "b1": (prompts[1], asking(5, 5)), "c1": (prompts[1], asking(2, 5)),
                        "p2": (prompts[2], plain)})
    ref = reference(make_tiny_engine, prompts[1])
    for rid, k in (("a1", 2), ("b1", 5), ("c1", 2)):
        assert_matches(delivered(seen[rid]), prompts[1], ref, k)
        assert [t for o in seen[rid] for t in o.new_token_ids] == alone[1]
    for rid, i in (("p0", 0), ("p2", 2)):
        assert all(o.prompt_logprobs is None for o in seen[rid])
        assert [t for o in seen[rid] for t in o.new_token_ids] == alone[i]
    assert_idle_and_clean(engine)


# ---- preemption and aborts -------------------------------------------------------------------
def spy_preemptions(engine) -> list:
    """What each preempted request held when preempted: its prompt logprobs so far or None."""
    held: list = []
    preempt = engine.scheduler._preempt

    def spy(request, plan):
        held.append((request.request_id, None if request.prompt_logprobs is None
                     else len(request.prompt_logprobs)))
        preempt(request, plan)
    engine.scheduler._preempt = spy
    return held


def test_preempted_mid_prompt_neither_duplicates_nor_loses(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=12, max_num_batched_tokens=4)
    held = spy_preemptions(engine)
    long = engine.tokenizer.encode(" ".join(TEXTS))[:40]
    earlier = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seen = run(engine, {"earlier": (long[:4], earlier), "long": (long, asking(3))})
    mid = [n for rid, n in held if rid == "long" and n is not None and 1 < n < len(long)]
    assert mid, f"no preemption mid-prompt: {held}"
    assert_matches(delivered(seen["long"]), long, reference(make_tiny_engine, long), 3)
    assert_idle_and_clean(engine)


def test_preempted_after_delivery_sends_nothing_again(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=12, max_num_batched_tokens=64)
    held = spy_preemptions(engine)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = make_tiny_engine().generate(prompts, params)
    seen = run(engine, {"earlier": (prompts[0], params),  # the later arrival is the victim
                        "asks": (prompts[1], asking(2, 16))})
    assert ("asks", None) in held  # preempted with its prompt logprobs already sent
    delivered(seen["asks"])
    assert [t for o in seen["asks"] for t in o.new_token_ids] == expected[1]
    assert_idle_and_clean(engine)


def test_aborted_mid_prompt_leaks_nothing(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=4)
    prompt = engine.tokenizer.encode(TEXTS[1])
    engine.add_request("r", prompt, asking(3))
    engine.step()
    final = engine.abort_request("r")
    assert final.finished and final.prompt_logprobs is None
    assert_idle_and_clean(engine)


# ---- speculation and disaggregation ----------------------------------------------------------
@pytest.mark.parametrize("spec", ["ngram", "self:1"])
def test_speculative_decoding_keeps_them(make_tiny_engine, spec):
    engine = make_tiny_engine(spec=spec, max_num_batched_tokens=7)
    prompt = engine.tokenizer.encode("The quick brown fox. The quick brown fox. The quick")
    outs = run(engine, {"r": (prompt, asking(2, 12))})["r"]
    assert_matches(delivered(outs), prompt, reference(make_tiny_engine, prompt), 2)
    plain = make_tiny_engine().generate([prompt], asking(2, 12))[0]
    assert [t for o in outs for t in o.new_token_ids] == plain
    assert engine.counters.spec_drafts > 0
    assert_idle_and_clean(engine)


def test_prefill_only_request_carries_them_in_its_first_output(make_tiny_engine):
    from tests.scaleout.harness import Pair
    pair = Pair(lambda: make_tiny_engine())
    try:
        prompt = pair.workers["p"].engine.tokenizer.encode(TEXTS[0])
        params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                  "prompt_logprobs": 2}
        first = pair.prefill("r", prompt, params)
        assert first["prefilled"] is not None
        pair.handoff("r", prompt, params, first)
        rest, final, _ = pair.decode_rest("r")
        assert first["tokens"] + rest == make_tiny_engine().generate([prompt], asking(2, 6))[0]
        assert final.get("prompt_logprobs") is None
        entries = first["prompt_logprobs"]
        ref = reference(make_tiny_engine, prompt)
        assert entries[0] is None and len(entries) == len(prompt)
        assert all(abs(e[1] - ref[i, prompt[i + 1]].item()) < TOL
                   for i, e in enumerate(entries[1:]))
    finally:
        pair.close()


# ---- the wire and refusals -------------------------------------------------------------------
def test_frame_shape_is_plain_json(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = engine.tokenizer.encode(TEXTS[2])
    outs = run(engine, {"r": (prompt, asking(2))})["r"]
    frame = decode_frame(encode_frame(Step([output_message(o) for o in outs], None))[4:])
    messages = frame.outputs
    assert "prompt_logprobs" not in messages[1]  # only the first output carries the key
    entries = messages[0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, (token, logprob, rank, top) in enumerate(entries[1:], start=1):
        assert token == prompt[i] and isinstance(rank, int) and rank >= 1
        assert MIN_LOGPROB <= logprob <= 0 and len(top) == 2
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in top)
    assert orjson.loads(orjson.dumps(entries)) == entries


def test_impossible_tokens_score_at_the_floor():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, 1.0], [2.0, 1.0, 0.0, -1.0]])
    scored = score_tokens(logits, torch.tensor([1, 2]), 3)
    assert scored[0].logprob == MIN_LOGPROB and scored[0].rank == 4
    assert [t for t, _ in scored[0].top][2] == 0 and scored[1].rank == 3
    assert scored[1].top[0][0] == 0 and scored[1].logprob == pytest.approx(
        torch.log_softmax(logits[1], 0)[2].item())


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=bad)
    assert err.value.param == "prompt_logprobs" and "prompt_logprobs" in str(err.value)
    with pytest.raises(ProtocolError, match="prompt_logprobs"):  # as the worker reads a frame
        frame_from_dict({"type": "add", "id": "r", "prompt": [1],
                         "params": {"prompt_logprobs": bad}})
    assert SamplingParams(prompt_logprobs=MAX_TOP_LOGPROBS).prompt_logprobs == MAX_TOP_LOGPROBS
