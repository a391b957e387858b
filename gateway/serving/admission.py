"""Admission: everything a request passes before the queue, in order: the tenant may use the
model, tokenization and the context and KV-capacity checks (with the one SamplingParams built
then), the time-to-first-token deadline, the rate limits, the budget reservation and the
fair-share start. A refusal at any point leaves nothing behind but the request's count
against its tenant's requests per minute, taken first: by `charged` before an HTTP body is
read, by `admit` itself for a WebSocket message."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from billing.keys import ApiKey, Tenant
from gateway.errors import APIError, bad_request, rate_limited
from gateway.openai.requests import GenerationRequest

if TYPE_CHECKING:
    from gateway.serving.accounting import Accounting
    from gateway.serving.inflight import InFlightRequest
    from gateway.serving.queue import RequestQueue
    from gateway.serving.service import GenerationService


class AdmissionView(Protocol):
    """What admission reads of the gateway (its state): the names served, the money, the
    service that tokenizes and queues, and the queue a deadline is judged against."""

    served_names: tuple[str, ...]
    model_name: str
    accounting: Accounting
    service: GenerationService | None
    queue: RequestQueue

SHARED_CACHE_SALT = "shared-namespace"  # the opt-in public prefix-cache namespace
# set while a handler runs whose request was charged before its body was read (the HTTP
# routes, through `charged`), so that `admit`, which WebSocket messages reach uncharged,
# charges each request once
_CHARGED: ContextVar[bool] = ContextVar("request_charged", default=False)


@asynccontextmanager
async def charged(state: AdmissionView, key: ApiKey) -> AsyncIterator[None]:
    """Count a request against its tenant's requests per minute (429) before its body is
    read, so that every refusal after this, a 400 included, costs the sender a request; inside,
    `admit` does not charge it again."""
    await state.accounting.take_request(key)
    token = _CHARGED.set(True)
    try:
        yield
    finally:
        _CHARGED.reset(token)


async def admit(state: AdmissionView, key: ApiKey, req: GenerationRequest, body: Any,
                trace_headers: dict | None = None,
                request_id: str | None = None) -> InFlightRequest:
    """Tenant checks, tokenization and admission: everything before the queue. `request_id`
    names the record when the endpoint has its own id scheme (the Responses API's resp_...)."""
    tenant = key.tenant
    check_model(state, tenant, req.model)
    if not _CHARGED.get():  # a WebSocket message: charged here, before tokenizing
        await state.accounting.take_request(key)
    salt = key.cache_salt
    if isinstance(body, dict) and body.get("cache_scope") == "shared":
        if not tenant.shared_cache:
            raise bad_request("this key may not use the shared prefix cache",
                              param="cache_scope")
        salt = SHARED_CACHE_SALT
    priority = max(req.priority, tenant.priority)  # never more urgent than the tenant's class
    service = state.service
    gen = await service.prepare(req, salt=salt, priority=priority, request_id=request_id)
    gen.model_name = state.model_name
    gen.trace_headers = trace_headers
    check_deadline(state, body, priority)
    await state.accounting.admit(gen, key)
    service.enqueue(gen)
    return gen


def check_model(state: AdmissionView, tenant: Tenant, model: str | None) -> None:
    """404 for a model this gateway does not serve (never serve and bill another one), or one
    the tenant may not use. No model named means the served one."""
    if model is not None and model not in state.served_names:
        raise model_not_found(f"The model `{model[:200]}` does not exist. This server serves "
                              f"{', '.join(state.served_names)}.")
    if not tenant.allows_model(state.served_names):
        raise model_not_found(f"The model `{model or state.model_name}` is not available to "
                              f"this key.")


def model_not_found(message: str) -> APIError:
    """OpenAI's answer for a model it does not have (status 404, code model_not_found)."""
    return APIError(404, message, "invalid_request_error", "model", code="model_not_found")


def check_deadline(state: AdmissionView, body: Any, priority: int) -> None:
    """Reject at once a request whose time-to-first-token deadline the queue cannot meet."""
    deadline = body.get("ttft_deadline_ms") if isinstance(body, dict) else None
    if deadline is None:
        return
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0:
        raise bad_request("ttft_deadline_ms must be a positive number", param="ttft_deadline_ms")
    ahead = sum(1 for e in state.queue.waiting() if e.priority <= priority)
    if ahead == 0:
        return
    rate = state.queue.drain_rate()
    expected = ahead / rate if rate > 0 else float("inf")
    if expected * 1000 > deadline:
        raise rate_limited(f"{ahead} requests are ahead in the queue; the first token would "
                           f"come after about {expected:.1f}s, past the deadline of "
                           f"{deadline:.0f} ms", retry_after_s=min(60, max(1, expected)))
