"""`POST /tokenize` and `POST /detokenize`, vLLM's shapes (gateway/openai/tokenize_api.py).

Each needs a key like generation does and counts against the tenant's requests per minute
(tokenizing a 4 MB body takes seconds of CPU), charged before the body is read so that a
refused body counts too, but nothing is billed: no model runs.
"""
from __future__ import annotations

from aiohttp import web

from gateway.http.auth import authenticate
from gateway.http.error_middleware import json_response
from gateway.http.request_body import read_json, validate
from gateway.openai.tokenize_api import (
    detokenize_response,
    parse_detokenize,
    parse_tokenize,
    tokenize_response,
)
from gateway.serving.admission import check_model
from gateway.state import STATE


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    service = state.require_service()  # the tokenizer arrives with the first worker
    await state.accounting.take_request(key)  # first: a refused body costs a request too
    body = await read_json(request, state.config.body_timeout_seconds)
    parsed = await validate(request, body, parse_tokenize)
    check_model(state, key.tenant, parsed.model)
    ids = await service.tokenize(parsed.request, parsed.add_generation_prompt,
                                 parsed.add_special_tokens)
    strs = [service.token_text(t) for t in ids] if parsed.return_token_strs else None
    return json_response(tokenize_response(ids, service.max_model_len, strs))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    service = state.require_service()
    await state.accounting.take_request(key)
    body = await read_json(request, state.config.body_timeout_seconds)
    model, ids = await validate(request, body, parse_detokenize, service.max_model_len)
    check_model(state, key.tenant, model)
    return json_response(detokenize_response(service.detokenize(ids)))


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
