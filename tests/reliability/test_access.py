"""Access: keys, admin-only surfaces, and prefix-cache isolation between tenants."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.reliability.conftest import auth
from tests.reliability.test_hostile_input import assert_openai_error

BAD_KEYS = {"no-key": None, "wrong-key": "sk-nobody", "revoked-key": "sk-revoked",
            "basic-scheme": "Basic c2stYWxwaGE=", "empty-bearer": ""}


async def _request(url, method, path, headers, json_body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, headers=headers, json=json_body) as r:
            return r.status, await r.read()


def _headers(name, key):
    if name == "basic-scheme":
        return {"Authorization": key}
    if name == "empty-bearer":
        return {"Authorization": "Bearer "}
    return auth(key)


@pytest.mark.parametrize("name", sorted(BAD_KEYS))
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/ws"), ("GET", "/admin/usage"),
                                         ("GET", "/admin/telemetry")])
def test_bad_keys_get_401(gw, name, method, path):
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    status, raw = asyncio.run(_request(gw.url, method, path, _headers(name, BAD_KEYS[name]),
                                       body if method == "POST" else None))
    assert status == 401, raw[:200]
    assert_openai_error(401, raw)


@pytest.mark.parametrize("path", ["/admin/usage", "/admin/usage?period=all",
                                  "/admin/telemetry"])
def test_admin_surfaces_refuse_tenant_keys(gw, path):
    status, raw = asyncio.run(_request(gw.url, "GET", path, auth("sk-alpha")))
    assert status == 403
    assert_openai_error(403, raw)
    assert asyncio.run(_request(gw.url, "GET", path.replace("telemetry", "usage"),
                                auth("sk-admin")))[0] == 200


@pytest.mark.parametrize("path", ["/admin/usage/", "//admin/usage", "/ADMIN/usage",
                                  "/admin/%2e%2e/admin/usage", "/v1/../admin/usage"])
def test_path_tricks_never_reach_admin(gw, path):
    status, _ = asyncio.run(_request(gw.url, "GET", path, auth("sk-alpha")))
    assert status in (403, 404), (path, status)


def test_cross_tenant_prefix_cache_probes_report_zero(gw):
    """Tenant alpha warms a long prefix; other tenants' first probes of the same text never
    hit, even with a client-supplied salt; alpha's own repeat does. (A tenant's second probe
    would hit its own first one: that is its cache, not alpha's.)"""
    def cached(prefix, key, **extra):
        status, body = gw.post_json("/v1/completions",
                                    {"prompt": prefix + "?", "max_tokens": 1, **extra}, key)
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]
    for probe in range(5):
        prefix = f"The secret plan number {probe} of tenant alpha is as follows. " * 20
        cached(prefix, "sk-alpha")
        assert cached(prefix, "sk-alpha") > 0  # the cache works for its owner
        assert cached(prefix, "sk-beta", cache_salt="anything", user="alpha") == 0
        assert cached(prefix, "sk-storm") == 0
        assert cached(prefix, "sk-vip", priority=0) == 0
    prefix = "The secret plan number 0 of tenant alpha is as follows. " * 20
    status, body = gw.post_json("/v1/completions", {"prompt": prefix, "max_tokens": 1,
                                                    "cache_scope": "shared"}, "sk-beta")
    assert status == 400 and body["error"]["param"] == "cache_scope"
