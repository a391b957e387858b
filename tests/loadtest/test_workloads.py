"""Workloads and arrivals are deterministic under a seed and have the promised shape."""
import itertools
import statistics

import orjson
import pytest

from loadtest.arrivals import arrival_times
from loadtest.dists import Dist
from loadtest.mix import Mix, parse_priorities, parse_tenants
from loadtest.workloads import WorkloadParams, make_workload


def take(name, n=40, seed=1, params=WorkloadParams(), mix=None):
    mix = mix or Mix.default()
    return list(itertools.islice(make_workload(name, params, mix, seed), n))


@pytest.mark.parametrize("name", ["shared-prefix", "chat", "random"])
def test_same_seed_same_requests(name):
    a, b, c = take(name), take(name), take(name, seed=2)
    assert [x.messages for x in a] == [x.messages for x in b]
    assert [x.messages for x in a] != [x.messages for x in c]


def test_shared_prefix_shares_the_report():
    params = WorkloadParams(prefix_len=50, num_prefixes=2, input_len=Dist.parse(5))
    specs = take("shared-prefix", 30, params=params)
    reports = {s.messages[0]["content"].split("\nQuestion:")[0] for s in specs}
    assert len(reports) == 2
    questions = {s.messages[0]["content"].split("\nQuestion:")[1] for s in specs}
    assert len(questions) == 30


def test_chat_resends_growing_history():
    params = WorkloadParams(users=3, turns=3, input_len=Dist.parse(4), output_len=Dist.parse(6))
    specs = take("chat", 12, params=params)
    user0 = [specs[i].messages for i in (0, 3, 6, 9)]
    assert [len(m) for m in user0] == [1, 3, 5, 1]  # three turns, then a new conversation
    assert user0[1][:1] == user0[0] and user0[2][:3] == user0[1]
    assert user0[1][1]["role"] == "assistant" and len(user0[1][1]["content"].split()) == 6


def test_random_lengths_follow_distribution():
    params = WorkloadParams(input_len=Dist.parse("uniform:10:20"),
                            output_len=Dist.parse("normal:50:5"))
    specs = take("random", 400, params=params)
    lens = [len(s.messages[0]["content"].split()) for s in specs]
    assert min(lens) >= 10 and max(lens) <= 20
    assert statistics.fmean(s.max_tokens for s in specs) == pytest.approx(50, abs=1.5)


def test_tenant_and_priority_mix_by_weight():
    mix = Mix(parse_tenants("gold=k1:3,free=k2:1", None), parse_priorities("0:1,2:1"))
    specs = take("random", 800, mix=mix)
    gold = sum(s.tenant == "gold" for s in specs) / len(specs)
    assert gold == pytest.approx(0.75, abs=0.05)
    assert {s.api_key for s in specs} == {"k1", "k2"} and {s.priority for s in specs} == {0, 2}
    assert all(s.priority is None for s in take("random", 5))


def test_trace_replay(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in [
        {"timestamp": 0.0, "prompt": "hi there", "output_length": 3, "tenant": "gold",
         "priority": 1},
        {"timestamp": 0.5, "input_length": 7, "output_length": 9}]))
    mix = Mix(parse_tenants("gold=k1", None), parse_priorities(None))
    specs = list(make_workload(f"trace:{path}", WorkloadParams(), mix, 0))
    assert [(s.arrival, s.max_tokens, s.tenant, s.api_key, s.priority) for s in specs] == [
        (0.0, 3, "gold", "k1", 1), (0.5, 9, "gold", "k1", None)]
    assert len(specs[1].messages[0]["content"].split()) == 7


@pytest.mark.parametrize("kind,burst", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0),
                                        ("constant", 1.0)])
def test_arrival_rate_and_burstiness(kind, burst):
    ts = list(itertools.islice(arrival_times(kind, 100.0, 7, burst), 4001))
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.01, rel=0.08)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    expected_cv = 0.0 if kind == "constant" else burst ** -0.5  # gamma: CV = 1/sqrt(shape)
    assert cv == pytest.approx(expected_cv, rel=0.12, abs=0.02)
    assert ts == list(itertools.islice(arrival_times(kind, 100.0, 7, burst), 4001))
