"""Day-one API fit on a real gateway: model names (404 for an unknown one, aliases, the key
file checked against them), /v1/models metadata, and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import requests

from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file

NAMES = ("smol", "gpt-4o-mini")
TENANTS = {"open": {}, "narrow": {"models": '["gpt-4o-mini"]'}, "ops": {}}
KEYS = [("sk-open", "open", False, False), ("sk-narrow", "narrow", False, False),
        ("sk-admin", "ops", True, False)]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("names")
    server = GatewayProcess("--fake", "--served-model-name", " ".join(NAMES),
                            "--sampling-defaults", "llama-cpp,temperature=0.5",
                            "--keys-file", write_key_file(tmp / "keys.toml", TENANTS, KEYS),
                            "--ledger-path", str(tmp / "ledger.sqlite3"))
    server.admin_key = "sk-admin"
    yield server
    server.stop()


def client(gw, key="sk-open"):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def post(gw, path, body, key="sk-open"):
    r = requests.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=10)
    return r.status_code, r.json()


def test_an_unknown_model_is_404_and_nothing_is_billed(gw):
    before = gw.metric("inferstack:revenue_usd_total")
    with pytest.raises(openai.NotFoundError) as info:
        client(gw).chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-4o" in error["message"] and "smol" in error["message"]
    status, body = post(gw, "/v1/completions", {"model": "llama-70b", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert gw.metric("inferstack:revenue_usd_total") == before
    assert gw.metric("inferstack:open_charges") == 0


def test_every_served_name_works_and_answers_under_the_first(gw):
    for name in NAMES:
        r = client(gw).chat.completions.create(model=name, messages=CHAT, max_tokens=3)
        assert r.model == NAMES[0] and r.usage.completion_tokens == 3
    # no model named (the SDK insists on one, so the body goes raw): the served one
    status, body = post(gw, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert status == 200 and body["model"] == NAMES[0]


def test_a_tenant_limited_to_an_alias_may_use_the_model_under_any_name(gw):
    r = client(gw, "sk-narrow").completions.create(model="smol", prompt="Once", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_models_lists_each_name_with_its_metadata(gw):
    data = client(gw).models.list().data
    assert [m.id for m in data] == list(NAMES)
    card = data[0].model_dump()
    assert card["root"] == "fake-smollm2" and card["max_model_len"] > 0
    # the fake engine's model has none of its own: the llama-cpp profile, one value changed
    assert card["sampling_defaults"] == {"temperature": 0.5, "top_k": 40, "top_p": 0.95,
                                         "min_p": 0.05}


def test_a_key_file_naming_a_model_not_served_stops_the_start(tmp_path):
    keys = write_key_file(tmp_path / "keys.toml", {"t": {"models": '["gpt-4o"]'}},
                          [("sk-t", "t", False, False)])
    proc = subprocess.run([sys.executable, "-m", "gateway", "--fake", "--port", "0",
                           "--keys-file", keys, "--served-model-name", "smol"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "gpt-4o" in proc.stderr and "not served" in proc.stderr


def test_a_bad_sampling_defaults_flag_stops_the_start():
    proc = subprocess.run([sys.executable, "-m", "gateway", "--fake", "--port", "0",
                           "--sampling-defaults", "top_p=7"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--sampling-defaults" in proc.stderr


def test_tokenize_counts_what_a_chat_is_billed_for(gw):
    status, tok = post(gw, "/tokenize", {"model": "smol", "messages": CHAT})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["token_strs"] is None
    r = client(gw).chat.completions.create(model="smol", messages=CHAT, max_tokens=1)
    assert r.usage.prompt_tokens == tok["count"]
    assert tok["max_model_len"] == client(gw).models.list().data[0].model_dump()["max_model_len"]
    _, open_turn = post(gw, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert open_turn["tokens"] == tok["tokens"][:open_turn["count"]]
    assert open_turn["count"] < tok["count"]


def test_tokenize_and_detokenize_round_trip_a_prompt(gw):
    text = "Paris, c'est la capitale — 東京 too 🙂"
    status, tok = post(gw, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and len(tok["token_strs"]) == tok["count"]
    r = client(gw).completions.create(model="smol", prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == tok["count"]
    status, back = post(gw, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and back == {"prompt": text}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 3000}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", [1], 400, None),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * 100_000}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
])
def test_bad_tokenize_bodies_get_openai_errors(gw, path, body, status, param):
    got, error = post(gw, path, body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param


def test_tokenize_needs_a_key(gw):
    assert post(gw, "/tokenize", {"prompt": "x"}, key="sk-wrong")[0] == 401
    assert post(gw, "/detokenize", {"tokens": [1]}, key="sk-wrong")[0] == 401
