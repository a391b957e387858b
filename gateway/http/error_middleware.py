"""Every error leaves the gateway as an OpenAI error body with the right status; on Anthropic's
routes (/v1/messages and below, unknown ones included) as Anthropic's error body with its
status instead, whatever raised it (auth, admission, body parsing, rate limits, the router)."""
from __future__ import annotations

import logging

import orjson
from aiohttp import web

from billing.stores import StoreUnavailable
from gateway.anthropic.errors import error_body as anthropic_error_body
from gateway.anthropic.errors import error_status, speaks_anthropic
from gateway.errors import APIError, error_body, store_unavailable

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}


def json_response(obj, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, headers=headers,
                        content_type="application/json")


def error_response(exc: APIError, request: web.Request | None = None) -> web.Response:
    """The error's response: OpenAI's body, or Anthropic's on its routes."""
    if request is not None and speaks_anthropic(request.path):
        return json_response(anthropic_error_body(exc.status, exc.message),
                             error_status(exc.status), exc.headers or None)
    return json_response(exc.body(), exc.status, exc.headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        _count(request, exc.status)
        return error_response(exc, request)
    except StoreUnavailable as exc:  # a shared store (PostgreSQL, Redis) down on any route
        _count(request, 503)
        return error_response(store_unavailable(str(exc), exc.retry_after), request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        _count(request, exc.status)
        message = {413: f"the request body is over the limit of {request.app._client_max_size} "
                        f"bytes", 404: f"no route for {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(
            exc.status, exc.reason)
        if speaks_anthropic(request.path):
            return json_response(anthropic_error_body(exc.status, message), exc.status)
        body = error_body(message, _TYPES.get(exc.status, "invalid_request_error"),
                          code={413: "body_too_large"}.get(exc.status))
        return json_response(body, exc.status)
    except Exception:  # noqa: BLE001 - never leak a stack trace to a client
        log.exception("unhandled error on %s %s", request.method, request.path)
        _count(request, 500)
        return error_response(APIError(500, "internal server error", "server_error"), request)


def _count(request: web.Request, status: int) -> None:
    from gateway.state import STATE
    metrics = request.app[STATE].metrics
    if metrics is not None:
        metrics.http_errors.labels(metrics.model, str(status)).inc()
