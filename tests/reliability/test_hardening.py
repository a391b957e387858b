"""The hardening defects on a real gateway (fake engine, loopback): each case failed before.

One request must never poison dispatch, freeze the loop, hold memory and a connection forever,
let a web page drive a key-less gateway, or show tenants to anyone who asks. After every case
on the shared gateway the invariant check of conftest.py runs (nothing leaked, the dispatch
loop ticking); the dedicated gateways here run the same check at their end.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess, free_port
from tests.reliability.conftest import Gateway, auth
from tests.reliability.test_hostile_input import _post, assert_openai_error

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MAX_SEED = (1 << 64) - 1


async def _complete(session, url: str, body: dict, key: str = "sk-alpha"):
    async with session.post(url + COMP, json=body, headers=auth(key),
                            timeout=aiohttp.ClientTimeout(total=60)) as r:
        return r.status, await r.json(content_type=None)


# ---- 1. one request poisons dispatch -----------------------------------------------------
def test_largest_seed_with_n_choices_is_served_even_from_the_queue(gw):
    """Before: choice 1 got seed 2^64, the frame encoder raised after choice 0 was counted in
    flight, the client got a 500, a slot and a reservation leaked, and a queued one killed the
    dispatch loop. All 8 slots are busy here, so these wait in the queue and go through it."""
    async def main():
        async with aiohttp.ClientSession() as s:
            blockers = [asyncio.create_task(_complete(s, gw.url, {"prompt": "busy",
                                                                  "max_tokens": 60}))
                        for _ in range(8)]
            await asyncio.sleep(0.05)
            edges = [{"prompt": "x", "max_tokens": 3, "n": n, "seed": seed}
                     for n in (2, 8) for seed in (MAX_SEED, -(1 << 63), MAX_SEED - 1)]
            results = await asyncio.gather(*(_complete(s, gw.url, b) for b in edges))
            again = await _complete(s, gw.url, edges[0])
            await asyncio.gather(*blockers)
            return edges, results, again
    edges, results, again = asyncio.run(main())
    for body, (status, answer) in zip(edges, results):
        assert status == 200, answer
        assert len(answer["choices"]) == body["n"]
    assert again[1]["choices"] == results[0][1]["choices"]  # seeded: reproducible


# ---- 3. one body freezes the loop ----------------------------------------------------------
def test_refused_work_is_charged_to_the_senders_rate_limit(gw):
    """A tenant allowed 3 requests a minute sends 3 prompts that are refused only after the
    gateway measured them: the 4th request, a valid one, is rate limited (before: refusals
    were free, so one sender could keep the gateway tokenizing)."""
    too_long = json.dumps({"prompt": "x" * 700_000, "max_tokens": 2}).encode()
    for _ in range(3):
        status, _, raw = asyncio.run(_post(gw.url, COMP, too_long, key="sk-metered"))
        assert status == 400, raw[:200]
    status, _, raw = asyncio.run(_post(gw.url, COMP, json.dumps(
        {"prompt": "hi", "max_tokens": 2}).encode(), key="sk-metered"))
    assert status == 429, raw[:200]
    assert_openai_error(429, raw)


# ---- 6. /metrics and /ready leak tenants and processes --------------------------------------
def test_metrics_need_an_admin_or_metrics_key(gw):
    assert gw.get("/metrics")[0] == 401
    assert gw.get("/metrics", "sk-alpha")[0] == 403
    status, body = gw.get("/metrics", "sk-prometheus")
    assert status == 200 and b"inferstack:revenue_usd" in body
    assert gw.get("/metrics", "sk-admin")[0] == 200
    assert gw.get("/admin/usage", "sk-prometheus")[0] == 403  # a metrics key is not an admin


def test_ready_shows_worker_pids_only_to_admins(gw):
    public = json.loads(gw.get("/ready")[1])
    assert public["ready"] is True and "worker_pids" not in public
    assert "worker_pids" not in json.loads(gw.get("/ready", "sk-alpha")[1])
    assert len(json.loads(gw.get("/ready", "sk-admin")[1])["worker_pids"]) == 1


# ---- 5. content types ------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_json_bodies_need_the_json_content_type(gw, content_type):
    async def main():
        headers = {**auth("sk-alpha")}
        if content_type:
            headers["Content-Type"] = content_type
        async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as s:
            async with s.post(gw.url + COMP, data=b'{"prompt": "hi", "max_tokens": 2}',
                              headers=headers) as r:
                return r.status, await r.read()
    status, raw = asyncio.run(main())
    assert status == 415
    assert json.loads(raw)["error"]["code"] == "unsupported_media_type"


# ---- 2 and 5. key-less mode -------------------------------------------------------------------
def test_keyless_gateway_refuses_to_listen_beyond_loopback():
    done = subprocess.run([sys.executable, "-m", "gateway", "--fake", "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, timeout=120)
    assert done.returncode != 0
    assert b"--keys-file" in done.stderr and b"--allow-insecure-no-auth" in done.stderr


@pytest.fixture(scope="module")
def keyless():
    server = GatewayProcess("--fake", "--fake-step-ms", "2")
    yield server
    server.stop()


async def _get_status(url: str, headers: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url, headers=headers) as r:
            return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("headers,status,code", [
    ({"Host": "evil.example"}, 403, "host_not_allowed"),  # DNS rebinding
    ({"Host": "evil.example:8000"}, 403, "host_not_allowed"),
    ({"Origin": "http://evil.example"}, 403, "origin_not_allowed"),
    ({"Origin": "null"}, 403, "origin_not_allowed"),
    ({"Host": "localhost:8000", "Origin": "http://localhost:5173"}, 200, None),
    ({}, 200, None)])
def test_keyless_gateway_answers_only_loopback_hosts_and_pages(keyless, headers, status, code):
    for path in ("/v1/models", "/admin/usage"):
        got, body = asyncio.run(_get_status(keyless.url + path, headers))
        assert got == status, body
        if code:
            assert body["error"]["code"] == code


@pytest.mark.parametrize("path", ["/v1/ws", "/admin/telemetry"])
def test_keyless_websockets_refuse_cross_site_pages(keyless, path):
    async def main():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await s.ws_connect(keyless.url + path, origin="http://evil.example")
            async with s.ws_connect(keyless.url + path, origin="http://localhost:3000") as ws:
                assert not ws.closed
        return refused.value.status
    assert asyncio.run(main()) == 403


def test_insecure_keyless_beyond_loopback_still_refuses_pages():
    server = GatewayProcess("--fake", "--host", "0.0.0.0", "--allow-insecure-no-auth")
    try:
        got, _ = asyncio.run(_get_status(server.url + "/v1/models", {"Host": "gpu-box:8000"}))
        assert got == 200  # the operator chose a public name
        got, _ = asyncio.run(_get_status(server.url + "/v1/models",
                                         {"Origin": "http://evil.example"}))
        assert got == 403
    finally:
        server.stop()


# ---- 4. a client that stops reading ----------------------------------------------------------
# about 1.2 kB of SSE per token: 10 MB a stream, more than the kernel's socket buffers hold
HEAVY = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 8000,
         "logprobs": True, "top_logprobs": 20, "stream": True}


def _stalled_http(port: int, path: str, body: dict, key: str) -> socket.socket:
    """Send a request, read the first bytes of the answer, then stop reading (4 kB buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), key.encode(), len(raw), raw))
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    return s


def _drain(s: socket.socket, timeout: float = 20.0) -> bytes:
    """Read what is left until the server closes (or resets) the connection."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    s.close()
    return out


def _wait_settled(server: Gateway, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server.settled()[0]:
        assert time.monotonic() < deadline, server.settled()[1]
        time.sleep(0.1)


def _limits_gateway(tmp_path_factory, send_timeout: int, buffer_bytes: int):
    """A dedicated gateway with these limits, checked for leaks when its module is done."""
    server = Gateway(tmp_path_factory.mktemp("limits"), "--fake-step-ms", "1",
                     "--send-timeout-seconds", str(send_timeout),
                     "--stream-buffer-bytes", str(buffer_bytes))
    yield server
    server.assert_baseline()
    server.stop()


@pytest.fixture(scope="module")
def stalls(tmp_path_factory):
    """Cut after 2 s without progress; a per-request buffer too large to matter."""
    yield from _limits_gateway(tmp_path_factory, 2, 256 << 20)


def test_sse_clients_that_stop_reading_are_cut_and_billed(stalls):
    """Before: 4 such streams took the gateway from 108 to 199 MB and stayed connected past
    the idle timeout. Now each is dropped 2 s after its writes stop moving, its request is
    aborted (blocks freed) and billed for what it produced."""
    rss = stalls.rss_bytes()
    socks = [_stalled_http(stalls.port, CHAT, HEAVY, "sk-alpha") for _ in range(4)]
    _wait_settled(stalls, 30)
    growth = stalls.rss_bytes() - rss
    tails = [_drain(s) for s in socks]
    rows = stalls.ledger_rows("status = 'cancelled'")
    assert len(rows) == 4, rows
    for r in rows:
        assert 0 < r["output_tokens"] < 8000 and r["cost_total"] > 0
    assert all(b"[DONE]" not in t for t in tails)
    assert growth < 60 << 20, growth


def _ws_frame(payload: bytes) -> bytes:
    """One masked client text frame (RFC 6455)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                            bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_websocket_peer_that_stops_reading_is_cut(stalls):
    """A raw WebSocket peer sends 4 heavy requests and never reads again (no pongs either)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", stalls.port))
    key = base64.b64encode(os.urandom(16))
    s.sendall(b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key +
              b"\r\nAuthorization: Bearer sk-beta\r\n\r\n")
    assert s.recv(12).startswith(b"HTTP/1.1 101")
    body = {k: v for k, v in HEAVY.items() if k != "stream"}
    for i in range(4):
        s.sendall(_ws_frame(json.dumps({"type": "request", "id": f"r{i}",
                                        "endpoint": "chat", "body": body}).encode()))
    _wait_settled(stalls, 30)
    _drain(s)
    rows = stalls.ledger_rows("tenant = 'beta' AND status = 'cancelled'")
    assert len(rows) == 4 and all(0 < r["output_tokens"] < 8000 for r in rows), rows


@pytest.fixture(scope="module")
def small_buffers(tmp_path_factory):
    """A 256 kB bound on each request's unread output, and a send timeout far away."""
    yield from _limits_gateway(tmp_path_factory, 120, 256 << 10)


def test_unread_output_is_bounded_per_request(small_buffers):
    """The client is still connected, but has left more than the bound unread: the request
    is aborted long before the send timeout and billed for what it produced."""
    rss = small_buffers.rss_bytes()
    socks = [_stalled_http(small_buffers.port, CHAT, HEAVY, "sk-alpha") for _ in range(4)]
    _wait_settled(small_buffers, 30)
    growth = small_buffers.rss_bytes() - rss
    rows = small_buffers.ledger_rows("status = 'cancelled'")
    assert len(rows) == 4 and all(0 < r["output_tokens"] < 8000 for r in rows), rows
    for s in socks:
        s.close()
    assert growth < 30 << 20, growth
