"""SSE wire format: exact event bytes, and a real loopback server streaming through SSEStream."""
from __future__ import annotations

import asyncio

from gateway.http.sse import DONE, KEEPALIVE, SSEStream, encode_event
from testkit.loopback import serve_once


def test_event_bytes_are_exact():
    assert encode_event({"a": 1, "b": "é\n"}) == b'data: {"a":1,"b":"\xc3\xa9\\n"}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    assert KEEPALIVE == b": keep-alive\n\n"


def test_stream_over_loopback_has_exact_body_and_headers():
    async def handler(request):
        stream = await SSEStream.open(request, headers={"x-request-id": "req-1"})
        assert await stream.send({"n": 1})
        assert await stream.keepalive()
        assert await stream.send({"n": 2})
        assert await stream.send_done()
        assert not stream.closed
        return stream.response

    async def client(session, url):
        async with session.get(url) as resp:
            return resp.status, resp.headers.copy(), await resp.read()

    status, headers, body = asyncio.run(serve_once("GET", handler, client))
    assert status == 200
    assert body == b'data: {"n":1}\n\n: keep-alive\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache"
    assert headers["Connection"] == "keep-alive"
    assert headers["X-Accel-Buffering"] == "no"
    assert headers["x-request-id"] == "req-1"


def test_client_disconnect_sets_closed_instead_of_raising():
    outcome: asyncio.Future

    async def handler(request):
        stream = await SSEStream.open(request)
        await stream.send({"n": 0})
        for _ in range(500):  # the reset shows up a write or two after the peer has gone
            if not await stream.send({"n": 1}):
                break
            await asyncio.sleep(0.01)
        outcome.set_result((stream.closed, await stream.send({"n": 2})))
        return stream.response

    async def client(session, url):
        nonlocal outcome
        outcome = asyncio.get_running_loop().create_future()
        resp = await session.get(url)
        assert await resp.content.readuntil(b"\n\n") == b'data: {"n":0}\n\n'
        resp.close()  # drop the connection mid-stream
        return await asyncio.wait_for(outcome, 5)

    closed, later_send = asyncio.run(serve_once("GET", handler, client))
    assert closed is True and later_send is False
