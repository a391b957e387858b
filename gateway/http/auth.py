"""Who is calling: the API key in `Authorization: Bearer KEY` (or `x-api-key: KEY`, as
Anthropic's clients send it; the same key store) names a tenant.

Without a key file the gateway is a single-tenant development server: every caller is the
administrator of the tenant "default" (and the gateway listens on loopback only). With
--api-key (INFERSTACK_API_KEY) it is the same single tenant, but every caller must send that key.
"""
from __future__ import annotations

import hashlib

from aiohttp import web

from billing.keys import ApiKey, KeyStore, Tenant
from gateway.errors import APIError, unauthorized

DEFAULT_KEY = ApiKey(hashlib.sha256(b"default").hexdigest(), Tenant("default"), "default",
                     admin=True)


def serving_keys(keys_file: str | None, api_key: str | None,
                 served_models: tuple[str, ...] | None = None) -> KeyStore | None:
    """The keys a gateway serves with: the key file's, else --api-key's one admin key of the
    tenant "default", else None (key-less). GatewayConfig refuses both together."""
    if keys_file:
        return KeyStore.from_toml(keys_file, served_models)
    if api_key:
        return KeyStore.single_admin(api_key, DEFAULT_KEY.tenant.name)
    return None


def presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return request.headers.get("x-api-key") or None


def authenticate(request: web.Request, store: KeyStore | None) -> ApiKey:
    """The caller's key, or 401 with an OpenAI error body."""
    if store is None:
        return DEFAULT_KEY
    secret = presented_key(request)
    if secret is None:
        raise unauthorized("no API key: send it as 'Authorization: Bearer KEY' or "
                           "'x-api-key: KEY'")
    key = store.lookup(secret)
    if key is None:
        raise unauthorized("invalid or revoked API key")
    return key


def require_admin(key: ApiKey) -> None:
    if not key.admin:
        raise APIError(403, "this endpoint needs an admin key", "permission_error")


def require_metrics_reader(key: ApiKey) -> None:
    """/metrics names tenants and their revenue: admins and keys marked `metrics = true`."""
    if not (key.admin or key.metrics):
        raise APIError(403, "/metrics needs an admin key or a key with metrics = true",
                       "permission_error")


def is_admin_caller(request: web.Request, store: KeyStore | None) -> bool:
    """Whether the request carries an admin key (always, without a key file); never raises."""
    try:
        return authenticate(request, store).admin
    except APIError:  # no key or a bad one: not an admin, and /ready still answers
        return False
