"""--api-key KEY (or INFERSTACK_API_KEY): one admin key protects every route a key file does."""
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from billing.keys import KeyStore
from gateway.config import GatewayConfig, load_config, refuse_open_keyless
from gateway.http.auth import serving_keys
from gateway.supervisor import child_environ
from testkit.gateway_server import GatewayProcess, free_port

KEY = "sk-flag-0123456789abcdef"
ENV_KEY = "sk-env-fedcba9876543210"


def routes_status(url: str, key: str | None) -> dict[str, int]:
    """The status of every route a key file protects, called with `key` (None: no key)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    gen = {"prompt": "x", "max_tokens": 1}

    async def main():
        out = {}
        async with aiohttp.ClientSession(headers=headers) as s:
            for path, body in (("/v1/completions", gen),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}],
                                 "max_tokens": 1}),
                               ("/tokenize", {"prompt": "hello"})):
                async with s.post(url + path, json=body) as r:
                    out[path] = r.status
            for path in ("/v1/models", "/metrics", "/admin/usage", "/admin/workers"):
                async with s.get(url + path) as r:
                    out[path] = r.status
            try:
                async with s.ws_connect(url + "/v1/ws") as ws:
                    await ws.close()
                    out["/v1/ws"] = 101
            except aiohttp.WSServerHandshakeError as exc:
                out["/v1/ws"] = exc.status
        return out
    return asyncio.run(main())


def assert_protected(url: str, key: str) -> None:
    for presented in (None, "sk-wrong", key + "x"):
        statuses = routes_status(url, presented)
        assert statuses == dict.fromkeys(statuses, 401), (presented, statuses)
    statuses = routes_status(url, key)
    assert statuses == {"/v1/completions": 200, "/v1/chat/completions": 200, "/tokenize": 200,
                        "/v1/models": 200, "/metrics": 200, "/admin/usage": 200,
                        "/admin/workers": 200, "/v1/ws": 101}, statuses


@pytest.fixture(scope="module")
def flag_gw(tmp_path_factory):
    ledger = str(tmp_path_factory.mktemp("apikey") / "ledger.sqlite3")
    server = GatewayProcess("--fake", "--api-key", KEY, "--ledger-path", ledger)
    yield server
    server.stop()


def test_api_key_protects_every_route_a_key_file_does(flag_gw):
    assert_protected(flag_gw.url, KEY)


def test_x_api_key_header_works_too(flag_gw):
    req = urllib.request.Request(flag_gw.url + "/v1/models", headers={"x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def test_environment_variable_works_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSTACK_API_KEY", ENV_KEY)
    server = GatewayProcess("--fake", "--ledger-path", str(tmp_path / "ledger.sqlite3"))
    try:
        assert_protected(server.url, ENV_KEY)
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as fh:
            assert ENV_KEY.encode() not in fh.read()
    finally:
        server.stop()


def test_key_never_in_the_log(tmp_path):
    """What the gateway writes (start, a refused request, a served one, the drain) never
    holds the key."""
    port, log = free_port(), tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--fake", "--port", str(port), "--api-key", KEY,
             "--ledger-path", str(tmp_path / "ledger.sqlite3")],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=out,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        statuses = routes_status(url, KEY)
        assert statuses["/v1/completions"] == 200
        assert routes_status(url, KEY[:-1])["/v1/completions"] == 401
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    text = log.read_bytes()
    assert b"listening on" in text
    assert KEY.encode() not in text and KEY[:-1].encode() not in text


def test_open_address_allowed_with_api_key():
    open_host = GatewayConfig(host="0.0.0.0", fake=True)
    with pytest.raises(SystemExit, match="--api-key"):
        refuse_open_keyless(open_host)
    refuse_open_keyless(GatewayConfig(host="0.0.0.0", fake=True, api_key=KEY))
    config = load_config(["--fake", "--host", "0.0.0.0"], environ={"INFERSTACK_API_KEY": KEY})
    assert config.api_key == KEY
    assert KEY not in repr(config)


def test_api_key_with_key_file_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SystemExit, match="do not mix"):
        load_config(["--fake", "--api-key", KEY, "--keys-file", str(tmp_path / "keys.toml")],
                    environ={})
    with pytest.raises(SystemExit, match="white space"):
        load_config(["--fake", "--api-key", KEY + " "], environ={})


def test_empty_environment_variable_means_no_key():
    config = load_config(["--fake"], environ={"INFERSTACK_API_KEY": ""})
    assert serving_keys(config.keys_file, config.api_key) is None


def test_one_admin_key_of_the_default_tenant():
    store = serving_keys(None, KEY)
    assert isinstance(store, KeyStore) and store.num_keys == 1
    key = store.lookup(KEY)
    assert key is not None and key.admin and key.metrics and key.tenant.name == "default"
    assert store.lookup("sk-wrong") is None and store.lookup(KEY.upper()) is None


def test_fleet_children_get_the_key_in_their_environment_not_argv():
    """--gateways N: each gateway child is `python -m gateway` with its settings in the
    environment (gateway/supervisor.py); the key arrives there and resolves the same."""
    config = GatewayConfig(fake=True, gateways=2, api_key=KEY, state_url="postgresql://x/y",
                           redis_url="redis://x")
    env = child_environ(config, gateways=1, workers=0, worker_urls=("tcp://127.0.0.1:1",),
                        reuse_port=True)
    assert env["INFERSTACK_API_KEY"] == KEY
    child = load_config([], environ=env)
    assert child.api_key == KEY and child.gateways == 1
