"""Scheduler on bookkeeping alone: token budget, chunking, admission order, preemption order."""
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.kv.manager import KVCacheManager
from runtime.scheduling.request import Request, RequestStatus
from runtime.scheduling.scheduler import Scheduler


def make(budget=32, seqs=8, blocks=16, block_size=4, chunked=True):
    cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=seqs,
                       num_blocks=blocks, enable_chunked_prefill=chunked)
    kv = KVCacheManager(blocks, block_size)
    return Scheduler(cfg, kv, max_model_len=1024), kv


def req(rid, n, priority=0, arrival=0.0):
    return Request(rid, list(range(n)), SamplingParams(max_tokens=64), priority, arrival)


def advance(sched, out, sampled_token=7):
    """Mimic the engine: count computed tokens, append a token to whoever finished a pass."""
    for r in sched.update_computed(out):
        r.output_token_ids.append(sampled_token)


def plan(out):
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def test_waiting_admitted_in_priority_then_arrival_order():
    sched, _ = make()
    sched.add_request(req("late", 3, priority=0, arrival=2.0))
    sched.add_request(req("urgent", 3, priority=-1, arrival=3.0))
    sched.add_request(req("early", 3, priority=0, arrival=1.0))
    out = sched.schedule()
    assert plan(out) == [("urgent", 3), ("early", 3), ("late", 3)]


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched, kv = make(budget=10)
    a = req("a", 3, arrival=0)
    sched.add_request(a)
    advance(sched, sched.schedule())  # a prefilled and sampled one token
    sched.add_request(req("long", 25, arrival=1))
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("long", 9)]
    assert out.num_scheduled_tokens == 10
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("long", 9)]
    advance(sched, out)
    assert plan(sched.schedule()) == [("a", 1), ("long", 7)]


def test_without_chunking_a_prompt_over_budget_waits():
    sched, _ = make(budget=10, chunked=False)
    sched.add_request(req("long", 12))
    assert sched.schedule().is_empty


def test_max_num_seqs_caps_running_requests():
    sched, _ = make(seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2, arrival=i))
    assert plan(sched.schedule()) == [("r0", 2), ("r1", 2)]
    assert sched.num_waiting == 1


def test_preemption_takes_least_urgent_latest_request_and_frees_its_blocks():
    # 4 blocks of 4 tokens; three requests of 4 tokens fill 3 blocks
    sched, kv = make(blocks=4, block_size=4)
    requests = {}
    for rid, prio, t in [("a", 0, 0.0), ("b", 1, 1.0), ("c", 0, 2.0)]:
        requests[rid] = req(rid, 4, priority=prio, arrival=t)
        sched.add_request(requests[rid])
    out = sched.schedule()
    advance(sched, out)
    assert plan(out) == [("a", 4), ("c", 4), ("b", 4)]
    assert kv.num_free_blocks == 1
    # each needs a new block for its 5th token: a gets the last one, c then forces b out
    out = sched.schedule()
    assert list(out.preempted_request_ids) == ["b"]
    assert plan(out) == [("a", 1), ("c", 1)]
    b = requests[out.preempted_request_ids[0]]
    assert b.status is RequestStatus.PREEMPTED and kv.block_ids("b") == [] and \
        b.num_computed_tokens == 0
    assert sched.waiting.peek() is b


def test_preempted_request_recomputes_prompt_and_output():
    sched, kv = make(blocks=2, block_size=4, budget=16)
    a, b = req("a", 4, arrival=0), req("b", 4, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    advance(sched, sched.schedule())
    out = sched.schedule()  # a needs a block: b is preempted
    assert list(out.preempted_request_ids) == ["b"]
    advance(sched, out)
    sched.finish_request(a, RequestStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert plan(out) == [("b", 5)]  # 4 prompt + 1 generated token are recomputed


def test_finish_frees_blocks_from_any_state():
    sched, kv = make(blocks=8)
    a, b = req("a", 5), req("b", 5, arrival=1)
    sched.add_request(a)
    sched.schedule()
    sched.add_request(b)
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 8
    assert not sched.has_unfinished_requests()


def test_urgent_arrival_preempts_least_urgent_when_slots_are_full():
    sched, kv = make(seqs=2)
    sched.add_request(req("low", 3, priority=5, arrival=0))
    sched.add_request(req("mid", 3, priority=1, arrival=1))
    advance(sched, sched.schedule())
    sched.add_request(req("urgent", 3, priority=-1, arrival=2))
    out = sched.schedule()
    assert list(out.preempted_request_ids) == ["low"]
    assert ("urgent", 3) in plan(out) and ("low", 1) not in plan(out)
    assert sorted(r.request_id for r in sched.running) == ["mid", "urgent"]


def test_equal_priority_arrival_waits_for_a_slot():
    sched, _ = make(seqs=1)
    sched.add_request(req("first", 3, arrival=0))
    advance(sched, sched.schedule())
    sched.add_request(req("second", 3, arrival=1))
    out = sched.schedule()
    assert list(out.preempted_request_ids) == [] and plan(out) == [("first", 1)]
