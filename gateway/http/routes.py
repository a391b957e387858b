"""Every HTTP route of the gateway, in one table."""
from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from gateway.billing.ledger import PERIOD_FORMATS
from gateway.errors import APIError, bad_request
from gateway.http.auth import authenticate, is_admin_caller, require_admin, require_metrics_reader
from gateway.http.completions import respond_json, stream_sse
from gateway.http.error_middleware import json_response
from gateway.http.feed_route import telemetry_handler
from gateway.http.openapi import build_openapi
from gateway.http.websocket import websocket_handler
from gateway.openai.requests import parse_request
from gateway.serving.admission import admit
from gateway.state import STATE


def trace_context(request: web.Request) -> dict | None:
    """The client's W3C trace context, continued by the request's span."""
    headers = {k: request.headers[k] for k in ("traceparent", "tracestate")
               if k in request.headers}
    return headers or None


async def read_json(request: web.Request, timeout: float | None = None):
    """The decoded body: 415 unless sent as JSON (a web page can post text/plain to a local
    gateway without asking first), 413 over the limit, 408 if it trickles in slower than
    `timeout`."""
    if request.content_type != "application/json":
        raise APIError(415, f"the body must be sent as Content-Type: application/json, not "
                       f"{request.headers.get('Content-Type', 'none')[:100]!r}",
                       code="unsupported_media_type")
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # over client_max_size: 413
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="body_timeout") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def generate(request: web.Request, kind: str):
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    state.require_service()  # 503 until a worker is ready, and while draining
    state.request_started()  # a drain waits for this handler
    try:
        body = await read_json(request, state.config.body_timeout_seconds)
        gen = await admit(state, key, parse_request(kind, body), body, trace_context(request))
        if gen.request.stream:
            return await stream_sse(request, state, gen)
        return await respond_json(state, gen)
    finally:
        state.request_ended()


async def usage(request: web.Request):
    """GET /admin/usage?period=hour|day|month|all&tenant=&since=&until= (unix seconds)."""
    state = request.app[STATE]
    require_admin(authenticate(request, state.keys))
    q = request.query
    period = q.get("period", "day")
    if period not in PERIOD_FORMATS:
        raise bad_request(f"period must be one of {sorted(PERIOD_FORMATS)}", param="period")
    bounds = {}
    for name in ("since", "until"):
        if name in q:
            try:
                bounds[name] = float(q[name])
            except ValueError:
                raise bad_request(f"{name} must be unix seconds", param=name) from None
    ledger = state.accounting.ledger
    await asyncio.to_thread(ledger.flush)
    rows = await asyncio.to_thread(ledger.totals, period, bounds.get("since"),
                                   bounds.get("until"), q.get("tenant"))
    return json_response({"object": "list", "period": period, "data": rows,
                          "prices": state.accounting.prices.as_dict()})


async def chat_completions(request: web.Request):
    return await generate(request, "chat")


async def completions(request: web.Request):
    return await generate(request, "completion")


async def models(request: web.Request):
    state = request.app[STATE]
    return json_response({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": int(state.started_at),
         "owned_by": "inferstack"}]})


async def health(request: web.Request):
    return json_response({"status": "ok"})


async def ready(request: web.Request):
    state = request.app[STATE]
    alive = sum(w.alive for w in state.workers)
    body: dict[str, object] = {"ready": bool(alive and state.service) and not state.draining,
            "draining": state.draining, "workers_ready": alive,
            "workers": len(state.workers),
            "uptime_seconds": round(time.time() - state.started_at, 3)}
    if is_admin_caller(request, state.keys):  # process ids are for operators only
        body["worker_pids"] = [w.pid if w.alive else None for w in state.workers]
    return json_response(body, 200 if body["ready"] else 503)


async def metrics(request: web.Request):
    """Prometheus exposition; with a key file, for admin keys and metrics keys only (it
    names tenants and their revenue): Prometheus sends one as `authorization.credentials`."""
    state = request.app[STATE]
    require_metrics_reader(authenticate(request, state.keys))
    if state.metrics is None:
        return web.Response(body=b"", content_type="text/plain")
    state.metrics.refresh(len(state.queue), state.workers,
                          state.accounting.budgets.total_reserved(),
                          state.dispatcher.is_alive(), state.inflight.open)
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request):
    return json_response(build_openapi(request.app[STATE].model_name))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/ws", websocket_handler)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/admin/usage", usage)
    app.router.add_get("/admin/telemetry", telemetry_handler)
