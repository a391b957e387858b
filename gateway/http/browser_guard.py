"""Keeps web pages out of a key-less gateway.

Without a key file every caller is the administrator, which is safe only if nothing but the
developer's own programs can call. A browser can: a page the developer visits may open a
WebSocket to the local gateway (browsers send no preflight for WebSockets, only an `Origin`
header), or reach it through DNS rebinding (a hostile name that resolves to 127.0.0.1, sent as
the `Host` header). So in key-less mode a request must name a loopback host, and a request that
comes from a page must come from a loopback origin. A plain client (curl, the openai package)
sends no `Origin` and a loopback `Host`, and passes. With keys, a page cannot authenticate (no
cookies are used, and a custom `Authorization` header needs a CORS preflight we never grant).
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from gateway.errors import APIError

LOOPBACK_NAMES = ("localhost",)


def is_loopback_name(host: str) -> bool:
    """`localhost`, `*.localhost`, or a loopback IP literal (IPv6 in brackets or not)."""
    host = host.strip().lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host part of a `Host` header value (without its port)."""
    return urlsplit("//" + header).hostname or ""


def is_loopback_origin(origin: str) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname or "")


def check_browser_access(request: web.Request, check_host: bool) -> None:
    """403 for a request from a non-loopback page, or (with `check_host`) for a non-loopback
    `Host` (DNS rebinding)."""
    host = request.headers.get("Host")
    if check_host and host is not None and not is_loopback_name(host_of(host)):
        raise APIError(403, f"this key-less gateway answers only to loopback host names, not "
                       f"{host[:100]!r}", "permission_error", code="host_not_allowed")
    origin = request.headers.get("Origin")
    if origin is not None and not is_loopback_origin(origin):
        raise APIError(403, f"requests from the web page {origin[:100]!r} are refused: this "
                       f"gateway has no API keys", "permission_error", code="origin_not_allowed")


def browser_guard(check_host: bool):
    """The middleware, for key-less mode. `check_host` is off only when the operator chose
    to serve key-less beyond loopback (--allow-insecure-no-auth)."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        check_browser_access(request, check_host)
        return await handler(request)
    return middleware
