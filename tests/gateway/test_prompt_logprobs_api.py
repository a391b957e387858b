"""prompt_logprobs through the gateway (vLLM's shape), on the fake engine's known distribution:
every prompt token is its most likely one at logprob -0.1, the n-th alternative at -0.1 n."""
from __future__ import annotations

import pytest
import requests

from testkit.gateway_server import GatewayProcess


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--fake")
    yield server
    server.stop()


def post(gw, path, body):
    r = requests.post(gw.url + path, json=body, timeout=10)
    return r.status_code, r.json()


def check_entries(entries, token_ids, token_strs, k):
    assert entries[0] is None and len(entries) == len(token_ids)
    for entry, token, text in zip(entries[1:], token_ids[1:], token_strs[1:]):
        own = entry[str(token)]
        assert own == {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": text}
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks == list(range(1, len(entry) + 1)) and len(entry) <= k + 1


def test_a_completion_scores_every_prompt_token(gw):
    prompt = "The quick brown fox jumps over the lazy dog"
    _, tok = post(gw, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    status, body = post(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                "prompt_logprobs": 3})
    assert status == 200
    choice = body["choices"][0]
    check_entries(choice["prompt_logprobs"], tok["tokens"], tok["token_strs"], 3)
    assert body["usage"]["prompt_tokens"] == tok["count"]


def test_prompt_logprobs_read_no_cache_and_each_choice_has_them(gw):
    prompt = "word " * 40  # more than two blocks: a second send would hit the cache
    body = {"prompt": prompt, "max_tokens": 1, "n": 2, "prompt_logprobs": 0}
    post(gw, "/v1/completions", {"prompt": prompt, "max_tokens": 1})  # warm the cache
    status, out = post(gw, "/v1/completions", body)
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for choice in out["choices"]:
        assert len(choice["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
        assert all(len(e) == 1 for e in choice["prompt_logprobs"][1:])  # k=0: its own only


def test_a_chat_answer_carries_them_beside_the_choices(gw):
    messages = [{"role": "user", "content": "Hello there"}]
    _, tok = post(gw, "/tokenize", {"messages": messages, "return_token_strs": True})
    status, body = post(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                     "prompt_logprobs": 1})
    assert status == 200
    check_entries(body["prompt_logprobs"], tok["tokens"], tok["token_strs"], 1)


def test_without_asking_there_are_none(gw):
    _, body = post(gw, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize("extra, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
])
def test_bad_values_are_400(gw, extra, param):
    status, body = post(gw, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **extra})
    assert status == 400 and body["error"]["param"] == param
