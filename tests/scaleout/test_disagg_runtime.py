"""Prefill/decode disaggregation inside the runtime: two workers in one process move KV over
a real gloo group; outputs, KV bytes and block accounting are checked exactly."""
from __future__ import annotations

import time

import pytest
import torch

from contract.sampling_params import SamplingParams
from tests.scaleout.harness import Pair

PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in
           enumerate((1, 3, 4, 9, 17, 33))]


@pytest.fixture(params=["off", "on"], ids=["in-order", "overlapped"])
def pair(make_tiny_engine, request):
    """Both workers with steps in order, then overlapped (runtime/execution/overlap.py): a prefill
    worker parks a request whose second step is already in flight, and drops that row."""
    p = Pair(lambda: make_tiny_engine(overlap=request.param))
    yield p
    p.close()


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_greedy_outputs_identical_to_colocated(pair, make_tiny_engine):
    reference = make_tiny_engine().generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        first = pair.prefill(rid, prompt, greedy(12))
        assert first["prefilled"] is not None and not first["finished"]
        pair.handoff(rid, prompt, greedy(12), first)
        rest, final, transfer = pair.decode_rest(rid)
        assert first["tokens"] + rest == reference[i]
        assert final["reason"] == "length" and final["usage"][2] == 12
        assert transfer["blocks"] == -(-len(prompt) // 4)
        assert "kv_transfer" in final["timing"]
    wait_until(lambda: all(w.engine.kv.pool.num_used_blocks == 0
                           for w in pair.workers.values()))


def test_transferred_kv_is_bitwise_equal(pair):
    sent, written = [], {}
    p_engine, d_engine = pair.workers["p"].engine, pair.workers["d"].engine
    export = p_engine.export_request

    def spy_export(rid):
        blocks = export(rid)
        sent.extend(b.clone() for b in blocks)
        return blocks
    p_engine.export_request = spy_export
    write = d_engine.runner.write_block

    def spy_write(block_id, kv):
        write(block_id, kv)
        written[block_id] = d_engine.runner.read_block(block_id)
    d_engine.runner.write_block = spy_write
    prompt = PROMPTS[-1]
    first = pair.prefill("kv", prompt, greedy(3))
    pair.handoff("kv", prompt, greedy(3), first)
    pair.decode_rest("kv")
    assert len(sent) == len(written) == -(-len(prompt) // 4)
    for a, b in zip(sent, written.values()):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_abort_during_transfer_frees_both_sides(pair):
    prompt = PROMPTS[-1]
    first = pair.prefill("a", prompt, greedy(20))
    p_pool = pair.workers["p"].engine.kv.pool
    d_pool = pair.workers["d"].engine.kv.pool
    assert p_pool.num_used_blocks > 0  # parked on the prefill side, blocks held
    key, tag = pair.handoff("a", prompt, greedy(20), first, export=False)  # receiver waits
    wait_until(lambda: d_pool.num_used_blocks > 0)
    pair.put("d", {"type": "abort", "id": "a"})
    pair.put("p", {"type": "abort", "id": "a"})
    wait_until(lambda: d_pool.num_used_blocks == 0 and p_pool.num_used_blocks == 0)
    # an export arriving after the abort sends nothing, and the receiver gives up at once
    pair.put("p", {"type": "export", "id": "a", "key": key, "tag": tag})
    # and the pair keeps working afterwards
    first = pair.prefill("b", PROMPTS[2], greedy(4))
    pair.handoff("b", PROMPTS[2], greedy(4), first)
    rest, _, _ = pair.decode_rest("b")
    assert len(first["tokens"] + rest) == 4
    wait_until(lambda: d_pool.num_used_blocks == 0 and p_pool.num_used_blocks == 0)


def test_request_ending_at_first_token_is_not_moved(pair):
    first = pair.prefill("one", PROMPTS[3], greedy(1))
    assert first["finished"] and "prefilled" not in first
    wait_until(lambda: pair.workers["p"].engine.kv.pool.num_used_blocks == 0)
