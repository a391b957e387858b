"""Admission: everything a request passes before the queue, in order: the tenant may use the
model, tokenization and context checks, the time-to-first-token deadline, the rate limits, the
budget reservation and the fair-share start. A refusal at any point leaves nothing behind."""
from __future__ import annotations

from gateway.errors import bad_request, not_found, rate_limited

SHARED_CACHE_SALT = "shared-namespace"  # the opt-in public prefix-cache namespace


async def admit(state, key, req, body, trace_headers: dict | None = None):
    """Tenant checks, tokenization and admission: everything before the queue."""
    tenant = key.tenant
    if not tenant.allows_model(req.model):
        raise not_found(f"model {req.model!r} is not available to this key", param="model")
    state.accounting.admit_request(key)  # before the work a refusal could make us do
    salt = key.cache_salt
    if isinstance(body, dict) and body.get("cache_scope") == "shared":
        if not tenant.shared_cache:
            raise bad_request("this key may not use the shared prefix cache",
                              param="cache_scope")
        salt = SHARED_CACHE_SALT
    priority = max(req.priority, tenant.priority)  # never more urgent than the tenant's class
    service = state.service
    gen = await service.prepare(req, salt=salt, priority=priority)
    gen.model_name = state.model_name
    gen.trace_headers = trace_headers
    check_deadline(state, body, priority)
    state.accounting.admit(gen, key)
    service.enqueue(gen)
    return gen


def check_deadline(state, body, priority: int) -> None:
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
