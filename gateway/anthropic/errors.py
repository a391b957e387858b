"""Anthropic's error shapes on its routes: the status a gateway error becomes (503 is 529,
overloaded), the error type each status is named by, and the body, whole or as a stream's
`error` event."""
from __future__ import annotations

from gateway.errors import APIError

ROUTE = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape: its routes, and any path below them."""
    return path == ROUTE or path.startswith(ROUTE + "/")


# the gateway's status -> (Anthropic's status, its error type)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 504: "timeout_error"}
OVERLOADED = 529  # Anthropic's status for a service that cannot take the request now


def error_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_type(status: int) -> str:
    if status in (503, OVERLOADED):
        return "overloaded_error"
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body for a gateway error of this status."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(exc: APIError) -> dict:
    """An error after the stream opened, as Anthropic sends it (`event: error`)."""
    return error_body(exc.status, exc.message)
