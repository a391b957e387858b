"""Admin routes of the elastic pool and the fleet, and the tasks behind them.

  GET    /admin/workers           every worker: index, kind, url or pid, alive, draining, load
  POST   /admin/workers           {"url": "tcp://HOST:PORT"} or {"spawn": true}: 201 when ready
  DELETE /admin/workers/{index}   drain it (202; `?wait=true`: 200 once it is gone)
  GET    /admin/fleet             every live gateway and worker (Redis), fleet revenue (ledger)

Changes need an admin key; the two readings also accept a metrics key, as /metrics does.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.errors import APIError, bad_request, not_found
from gateway.http.auth import authenticate, require_admin, require_metrics_reader
from gateway.http.error_middleware import json_response
from gateway.http.request_body import read_json
from gateway.serving.autoscale import autoscale_loop, policy_from_config
from gateway.serving.fleet_registry import (
    TOTALS_EVERY_SECONDS,
    FleetRegistry,
    describe_gateway,
    fleet_totals,
    gateway_id,
)
from gateway.serving.worker_pool import DRAIN_TIMEOUT_SECONDS, PoolError, WorkerPool, describe
from gateway.state import STATE

POOL = web.AppKey("worker_pool", WorkerPool)
FLEET = web.AppKey("fleet_registry", FleetRegistry)
GATEWAY_ID = web.AppKey("gateway_id", str)


def _api_error(exc: PoolError) -> APIError:
    if exc.status == 400:
        return bad_request(str(exc), exc.param)
    if exc.status == 404:
        return not_found(str(exc), exc.param)
    if exc.status == 409:
        return APIError(409, str(exc), "invalid_request_error", exc.param, code="conflict")
    return APIError(502, str(exc), "server_error", code="worker_unavailable")


async def list_workers(request: web.Request):
    state = request.app[STATE]
    require_metrics_reader(authenticate(request, state.keys))
    return json_response({"object": "list", "data": request.app[POOL].describe_all()})


async def add_worker(request: web.Request):
    state = request.app[STATE]
    require_admin(authenticate(request, state.keys))
    body = await read_json(request, state.config.body_timeout_seconds)
    if not isinstance(body, dict) or ("url" in body) == ("spawn" in body):
        raise bad_request('send {"url": "tcp://HOST:PORT"} or {"spawn": true}')
    pool = request.app[POOL]
    try:
        if "url" in body:
            if not isinstance(body["url"], str):
                raise bad_request("url must be a string", param="url")
            worker = await pool.add_remote(body["url"])
        else:
            if body["spawn"] is not True:
                raise bad_request("spawn must be true", param="spawn")
            worker = await pool.spawn()
    except PoolError as exc:
        raise _api_error(exc) from None
    return json_response(describe(worker), 201)


async def remove_worker(request: web.Request):
    state = request.app[STATE]
    require_admin(authenticate(request, state.keys))
    try:
        index = int(request.match_info["index"])
    except ValueError:
        raise bad_request("the worker index must be an integer", param="index") from None
    pool = request.app[POOL]
    try:
        worker = pool.get(index)
        task = pool.drain(index)
    except PoolError as exc:
        raise _api_error(exc) from None
    if request.query.get("wait") in ("1", "true"):
        await asyncio.shield(task)  # a caller that leaves does not stop the drain
        return json_response({**describe(worker), "removed": True})
    return json_response({**describe(worker, True), "removed": False}, 202)


async def fleet(request: web.Request):
    state = request.app[STATE]
    require_metrics_reader(authenticate(request, state.keys))
    registry = request.app.get(FLEET)
    me = describe_gateway(state, request.app[POOL], request.app[GATEWAY_ID])
    gateways = await registry.read() if registry is not None else [me]
    if not any(g.get("id") == me["id"] for g in gateways):
        gateways.append(me)  # this one answers even while Redis does not
    workers = [{**w, "gateway": g.get("id")} for g in gateways for w in g.get("workers", [])]
    return json_response({
        "gateways": gateways, "workers": workers,
        "totals": await fleet_totals(state.accounting.ledger),
        "ledger": "shared" if state.config.state_url else "this gateway's",
        "registry": "redis" if registry is not None else "none"})


def add_admin_worker_routes(app: web.Application) -> None:
    state = app[STATE]
    pool = WorkerPool(state, float(getattr(state.config, "worker_drain_seconds",
                                           DRAIN_TIMEOUT_SECONDS)))
    app[POOL] = pool
    ident = gateway_id(state.config)
    app[GATEWAY_ID] = ident
    if state.config.redis_url:
        app[FLEET] = FleetRegistry(state.config.redis_url, ident,
                                   lambda: describe_gateway(state, pool, ident),
                                   float(getattr(state.config, "fleet_ttl_seconds", 5.0)))
    app.router.add_get("/admin/workers", list_workers)
    app.router.add_post("/admin/workers", add_worker)
    app.router.add_delete("/admin/workers/{index}", remove_worker)
    app.router.add_get("/admin/fleet", fleet)
    app.cleanup_ctx.append(elastic_lifecycle)


async def elastic_lifecycle(app: web.Application):
    """The autoscale loop and the fleet heartbeat, for as long as the app runs."""
    state, pool, registry = app[STATE], app[POOL], app.get(FLEET)
    tasks = []
    policy = policy_from_config(state.config)
    if policy is not None:
        tasks.append(asyncio.create_task(autoscale_loop(pool, policy, state.stop),
                                         name="autoscale"))
    if registry is not None:
        tasks.append(asyncio.create_task(registry.run(state.stop), name="fleet-registry"))
        tasks.append(asyncio.create_task(_totals_loop(state, registry), name="fleet-totals"))
        state.snapshots.fleet = registry.view
    yield
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    if registry is not None:
        await registry.close()


async def _totals_loop(state, registry: FleetRegistry) -> None:
    """Fleet revenue for the live feed, summed from the ledger every few seconds."""
    while not state.stop.is_set():
        try:
            registry.totals = await fleet_totals(state.accounting.ledger)
        except Exception:  # noqa: BLE001 - a store outage: the last totals stand
            pass
        await asyncio.sleep(TOTALS_EVERY_SECONDS)
