"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel. The batch object is OpenAI's, read from the store on every call,
so any gateway sharing the store answers for any batch; a tenant sees only its own batches
(another tenant's id: 404). Running the batches is the runner's (gateway/batch/runner.py).
"""
from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gateway.batch.lines import ENDPOINTS
from gateway.batch.sql import OPEN
from gateway.batch.store import new_id
from gateway.errors import APIError, bad_request, not_found
from gateway.http.error_middleware import json_response
from gateway.http.files_route import caller, file_missing, page_limit
from gateway.http.request_body import read_json

WINDOWS = {"24h": 24 * 3600}  # the completion windows OpenAI offers, in seconds
MAX_METADATA = (16, 64, 512)  # pairs, key characters, value characters


def batch_object(row: tuple) -> dict:
    (bid, _, _, endpoint, input_file_id, window, status, created_at, expires_at,
     in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at,
     cancelled_at, total, metadata, errors, output_file_id, error_file_id,
     completed, failed) = row
    return {"id": bid, "object": "batch", "endpoint": endpoint,
            "errors": orjson.loads(errors) if errors else None,
            "input_file_id": input_file_id, "completion_window": window, "status": status,
            "output_file_id": output_file_id, "error_file_id": error_file_id,
            "created_at": created_at, "in_progress_at": in_progress_at,
            "expires_at": expires_at, "finalizing_at": finalizing_at,
            "completed_at": completed_at, "failed_at": failed_at, "expired_at": expired_at,
            "cancelling_at": cancelling_at, "cancelled_at": cancelled_at,
            "request_counts": {"total": int(total), "completed": int(completed),
                               "failed": int(failed)},
            "metadata": orjson.loads(metadata) if metadata else None}


def batch_missing(batch_id: str) -> APIError:
    return not_found(f"No such Batch object: {batch_id[:100]}")


def _metadata(value: Any) -> str | None:
    if value is None:
        return None
    pairs, key_len, value_len = MAX_METADATA
    if not isinstance(value, dict) or len(value) > pairs or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= key_len
            and len(v) <= value_len for k, v in value.items()):
        raise bad_request(f"metadata must be an object of at most {pairs} string values, keys "
                          f"of at most {key_len} characters and values of at most {value_len}",
                          param="metadata")
    return orjson.dumps(value).decode()


async def create_batch(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, not "
                          f"{str(endpoint)[:100]!r}", param="endpoint", code="invalid_endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise bad_request(f"completion_window must be one of {', '.join(WINDOWS)}",
                          param="completion_window")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request("input_file_id must be a file id", param="input_file_id")
    row = await runner.store.get_file(tenant, file_id)
    if row is None:
        raise file_missing(file_id, "input_file_id")
    if row[2] != "batch":
        raise bad_request(f"file {file_id} has purpose {row[2]!r}, not 'batch'",
                          param="input_file_id")
    if await runner.store.count_open(tenant) >= runner.settings.max_open:
        raise APIError(429, f"this tenant has {runner.settings.max_open} batches open, the "
                       "most allowed (--batch-max-open); wait for one to end",
                       "rate_limit_error", code="too_many_open_batches")
    batch_id = new_id("batch_")
    now = int(time.time())
    await runner.store.create_batch(batch_id, tenant, key.sha256, endpoint, file_id, window, now,
                                    now + WINDOWS[window], metadata)
    runner.wake()
    return json_response(batch_object(await runner.store.get_batch(tenant, batch_id)))


async def get_batch(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    batch_id = request.match_info["batch_id"]
    row = await runner.store.get_batch(tenant, batch_id)
    if row is None:
        raise batch_missing(batch_id)
    return json_response(batch_object(row))


async def list_batches(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    limit = page_limit(request, 20, 100)
    rows = await runner.store.list_batches(tenant, request.query.get("after", "")[:200],
                                           limit + 1)
    data = [batch_object(r) for r in rows[:limit]]
    return json_response({"object": "list", "data": data, "has_more": len(rows) > limit,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


async def cancel_batch(request: web.Request):
    """validating or in_progress -> cancelling; the runner holding the batch stops its lines,
    writes the files of what finished and ends it as cancelled."""
    runner, key = caller(request)
    tenant = key.tenant.name
    batch_id = request.match_info["batch_id"]
    row = await runner.store.get_batch(tenant, batch_id)
    if row is None:
        raise batch_missing(batch_id)
    moved = await runner.store.move(batch_id, "cancelling", ("validating", "in_progress"),
                                    "cancelling_at", int(time.time()))
    if moved:
        runner.note_cancelling(batch_id)
    else:
        status = (await runner.store.get_batch(tenant, batch_id))[6]
        if status not in ("cancelling", "cancelled") and status not in OPEN:
            raise APIError(409, f"batch {batch_id} is {status}: it can no longer be cancelled",
                           code="batch_not_cancellable")
    return json_response(batch_object(await runner.store.get_batch(tenant, batch_id)))


def add_batches_routes(app: web.Application) -> None:
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
