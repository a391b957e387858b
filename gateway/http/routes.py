"""Every HTTP route of the gateway, in one table."""
from __future__ import annotations

import asyncio
import functools
import time

from aiohttp import web

from billing.ledger import PERIOD_FORMATS
from gateway.batch.runner import BATCH
from gateway.errors import bad_request
from gateway.http.admin_workers import add_admin_worker_routes
from gateway.http.auth import authenticate, is_admin_caller, require_admin, require_metrics_reader
from gateway.http.batches_route import add_batches_routes
from gateway.http.completions import respond_json, stream_sse
from gateway.http.error_middleware import json_response
from gateway.http.feed_route import telemetry_handler
from gateway.http.files_route import add_files_routes
from gateway.http.messages_route import add_messages_routes
from gateway.http.openapi import build_openapi
from gateway.http.request_body import generation, trace_context, validate
from gateway.http.responses_route import add_responses_routes
from gateway.http.tokenize_route import add_tokenize_routes
from gateway.http.websocket import websocket_handler
from gateway.openai.requests import parse_request
from gateway.openai.schema.answers import ModelList
from gateway.serving.admission import admit
from gateway.state import STATE


async def generate(request: web.Request, kind: str):
    async with generation(request) as (state, key, body):
        req = await validate(request, body, functools.partial(parse_request, kind),
                             state.sampling_defaults)
        gen = await admit(state, key, req, body, trace_context(request))
        if gen.request.stream:
            return await stream_sse(request, state, gen)
        return await respond_json(state, gen)


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
    """One card per served name (aliases too), as vLLM lists them, with what the model
    does for omitted sampling fields. Any valid key may list them (vLLM's --api-key too)."""
    state = request.app[STATE]
    authenticate(request, state.keys)
    service = state.service
    body: ModelList = {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(state.started_at),
         "owned_by": "inferstack", "root": state.model_root, "parent": None,
         "max_model_len": service.max_model_len if service is not None else None,
         "sampling_defaults": state.sampling_defaults if service is not None else None}
        for name in state.served_names]}
    return json_response(body)


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
                          state.dispatcher.is_alive(), state.inflight.open,
                          state.dispatcher.worker_time.total())
    state.metrics.refresh_tiers(state.snapshots.tier_frame())  # online and batch apart
    if state.snapshots is not None and state.snapshots.fleet is not None:
        state.metrics.fleet.refresh(state.snapshots.fleet())  # the same on every gateway
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request):
    return json_response(build_openapi(request.app[STATE].served_names))


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
    add_tokenize_routes(app)
    add_responses_routes(app)
    add_messages_routes(app)  # Anthropic's Messages API
    add_admin_worker_routes(app)  # and the pool's, autoscale's and the fleet's tasks
    if BATCH in app:  # --batch-api (on by default)
        add_files_routes(app)
        add_batches_routes(app)
