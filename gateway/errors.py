"""HTTP errors in OpenAI's shape: one exception type, and the body every client already parses.

Every failure the gateway reports, before or during a stream, is an `APIError`; its `body()` is
exactly `{"error": {"message", "type", "param", "code"}}`, so OpenAI SDKs surface it unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping

from contract.errors import InvalidRequestError, PromptTooLongError


class APIError(Exception):
    """An HTTP error response: status, OpenAI error fields, and extra headers (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, type={self.type!r}, "
                f"param={self.param!r})")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; every key is always present (null when unknown)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# the statuses the gateway uses, each with the `type` OpenAI pairs with it

def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "invalid API key") -> APIError:
    return APIError(401, message, "authentication_error", code="invalid_api_key")


def payment_required(message: str) -> APIError:
    # OpenAI reports spent quota as 429 insufficient_quota; a distinct 402 lets clients tell
    # "slow down" (retry later) from "top up" (retrying never helps).
    return APIError(402, message, "insufficient_quota", code="insufficient_quota")


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, code=code)


def rate_limited(message: str, retry_after_s: float | None = None) -> APIError:
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded",
                    headers=_retry_after(retry_after_s))


def server_error(message: str = "internal server error") -> APIError:
    return APIError(500, message, "server_error")


def store_unavailable(message: str, retry_after_s: float | None = None) -> APIError:
    # a shared store (budgets, rate limits) did not answer: the request is refused rather than
    # served unmetered, and the client may retry here or on another gateway
    return APIError(503, message, "server_error", code="store_unavailable",
                    headers=_retry_after(retry_after_s))


def from_runtime_error(exc: Exception) -> APIError:
    """The HTTP error for an exception the runtime raised while admitting or running a request."""
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), exc.param or "messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    # anything else is our fault, not the client's: say so without leaking internals
    return server_error()


def _retry_after(seconds: float | None) -> dict[str, str]:
    # Retry-After carries whole seconds; round up so a client never retries too early
    if seconds is None:
        return {}
    return {"Retry-After": str(max(1, int(-(-seconds // 1))))}
