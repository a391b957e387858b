"""Bodies the transport cannot hand over as JSON: each is a 4xx with an OpenAI error body on
every route that reads one (a body marked with an encoding it is not in, another media type,
nesting past the parser's depth), never a 500 with a stack trace in the log. The conftest's
after-every-case check (no charge, slot or queue entry left) runs after each."""
from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest

from tests.reliability.conftest import auth
from tests.reliability.test_hostile_input import assert_openai_error

BODY = json.dumps({"model": "fake-smollm2", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()
ROUTES = ["/v1/chat/completions", "/tokenize", "/admin/workers"]
NESTED = b'{"url": ' + b"[" * 5000 + b"]" * 5000 + b"}"


async def _send(url: str, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url + path, data=body, timeout=aiohttp.ClientTimeout(total=30),
                          headers={**auth("sk-admin"), **headers}) as r:
            return r.status, await r.read()


def send(gw, path: str, body: bytes, **headers: str) -> tuple[int, bytes]:
    return asyncio.run(_send(gw.url, path, body, headers))


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_marked_gzip_that_is_not_gzip_is_a_400(gw, path):
    status, raw = send(gw, path, BODY, **{"Content-Type": "application/json",
                                          "Content-Encoding": "gzip"})
    assert status == 400, raw
    assert assert_openai_error(status, raw)["code"] == "invalid_body_encoding"


def test_a_gzip_body_that_is_gzip_is_read(gw):
    status, raw = send(gw, "/tokenize", gzip.compress(json.dumps({"prompt": "hi"}).encode()),
                       **{"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200, raw


def test_the_admin_workers_route_takes_only_json(gw):
    status, raw = send(gw, "/admin/workers", b'{"spawn": true}', **{"Content-Type":
                                                                       "text/plain"})
    assert status == 415, raw
    assert json.loads(raw)["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("path", ROUTES)
def test_nesting_past_the_parser_depth_is_a_400(gw, path):
    status, raw = send(gw, path, NESTED, **{"Content-Type": "application/json"})
    assert status == 400, raw
    assert_openai_error(status, raw)
