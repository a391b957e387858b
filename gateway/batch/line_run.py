"""One batch line run as the online route runs it: the same validator, the same admission
(`admit`: model, tokenization, rate limits, budget reservation, fair-share start), the same
queue, worker and accounting, and the same answer builder, whose JSON becomes the line's
`response.body`. Only three things differ, all set before the accounting sees the record:
its tier ("batch") and batch id, its priority (the least urgent class, BATCH_PRIORITY, which
any online request preempts), and its id, derived from (batch, custom_id, attempt), so that a
line run again after a crash settles under the id it had (the ledger keeps one row per id).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from billing.keys import ApiKey
from gateway.batch.lines import ENDPOINTS, Line, line_request_id, parse_body
from gateway.errors import APIError
from gateway.http import completions, responses_route
from gateway.http.request_body import off_loop
from gateway.openai.responses_api import parse_responses_request, response_shell
from gateway.openai.schema.chat import MAX_PRIORITY
from gateway.serving.accounting import Accounting
from gateway.serving.admission import admit
from gateway.serving.inflight import InFlightRequest
from gateway.serving.queue import RequestQueue
from gateway.state import GatewayState

BATCH_PRIORITY = MAX_PRIORITY + 1  # less urgent than any class an online request may ask for
ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}  # the ledger's kind
MAX_ATTEMPTS = 5  # tries a line gets through failures that were not its own (429, 503, 5xx)


class LineRetry(Exception):
    """The line could not run now for a reason not its own: run it again later."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def engine_request_id(kind: str, batch_id: str, custom_id: str, attempt: int) -> str:
    digest = hashlib.blake2b(f"{batch_id}\0{custom_id}".encode(), digest_size=12).hexdigest()
    return f"{ID_PREFIX[kind]}batch{digest}" + (f"-{attempt}" if attempt else "")


class TieredService:
    """The generation service as `admit` sees it for a batch line: `prepare` marks the record
    as the batch tier's before `admit` charges it (the price book's batch multiplier reads it)."""

    def __init__(self, service: Any, batch_id: str,
                 on_record: Callable[[InFlightRequest], None] | None = None):
        self.service = service
        self.batch_id = batch_id
        self.on_record = on_record  # the runner follows the record's phase

    async def prepare(self, request, salt=None, request_id=None, priority=None
                      ) -> InFlightRequest:
        gen = await self.service.prepare(request, salt=salt, request_id=request_id,
                                         priority=BATCH_PRIORITY)
        gen.tier, gen.batch_id = "batch", self.batch_id
        if self.on_record is not None:
            self.on_record(gen)
        return gen

    def enqueue(self, gen: InFlightRequest) -> None:
        self.service.enqueue(gen)


@dataclass
class BatchAdmission:
    """What `admit` reads (its AdmissionView), with the batch's service in place."""

    served_names: tuple[str, ...]
    model_name: str
    accounting: Accounting
    service: Any
    queue: RequestQueue


async def run_line(state: GatewayState, key: ApiKey, batch_id: str, endpoint: str, line: Line,
                   attempt: int, on_record: Callable[[InFlightRequest], None] | None = None
                   ) -> tuple[int, str, dict]:
    """(status, request id, body) of the line's answer; LineRetry when it should run again."""
    kind = ENDPOINTS[endpoint]
    rid = engine_request_id(kind, batch_id, line.custom_id, attempt)
    state.require_service()  # 503 (retried) while draining or no worker is ready
    view = BatchAdmission(state.served_names, state.model_name, state.accounting,
                          TieredService(state.service, batch_id, on_record), state.queue)
    # only the prefix-cache scope of the body reaches admission: a batch has no TTFT deadline
    scope = {"cache_scope": line.body["cache_scope"]} if "cache_scope" in line.body else None
    try:
        if kind == "responses":
            body = await _run_turn(state, key, view, line.body, rid)
        else:
            req = await off_loop(parse_body, kind, line.body, state.sampling_defaults)
            gen = await admit(view, key, req, scope, request_id=rid)
            body = _decoded(await completions.respond_json(state, gen))
    except APIError as exc:
        if exc.status in (429, 503) or exc.status >= 500:
            raise LineRetry(exc) from None
        return exc.status, rid, exc.body()
    return 200, rid, body


async def _run_turn(state: GatewayState, key: ApiKey, view: BatchAdmission, body: dict,
                    rid: str) -> dict:
    """A Responses line, as `responses_route.admit_turn` and `respond_json` answer it."""
    req = parse_responses_request(body)
    chat = await off_loop(parse_body, "responses", body, state.sampling_defaults)
    scope = {"cache_scope": body["cache_scope"]} if "cache_scope" in body else None
    try:
        gen = await admit(view, key, chat, scope, request_id=rid)
    except APIError as exc:
        raise req.renamed(exc, 0) from None
    # kept for previous_response_id only when the line asks: a large batch would otherwise
    # push the tenant's online conversations out of the bounded store
    stored = body.get("store") is True and state.response_store.enabled
    shell = response_shell(rid, req, chat, state.model_name, stored)
    turn = responses_route.Turn(state, key.tenant.name, req, (), shell)
    return _decoded(await responses_route.respond_json(turn, gen))


def _decoded(response) -> dict:
    return orjson.loads(response.body)


def output_line(batch_id: str, custom_id: str, status: int, rid: str, body: dict) -> dict:
    """The output (or, for a status other than 200, error) file line of an answered request."""
    return {"id": line_request_id(batch_id, custom_id), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": rid, "body": body},
            "error": None}
