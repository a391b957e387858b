"""The OpenAPI 3.1 document of the gateway's HTTP and WebSocket API.

Only the paths, their operations and the WebSocket's description are written here: every
component schema is generated from the declarations the gateway validates and answers with
(gateway/openai/schema/), so the document cannot drift from what is accepted or sent. The
components are generated once per process; the served names are filled in per document.

OpenAPI has no way to describe WebSocket messages: `/v1/ws` is the upgrade (a GET answered
101) and lists its messages both ways in `x-websocket-messages`, each a component schema
(gateway/openai/schema/websocket.py).
"""
from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import TypeAdapter
from pydantic.json_schema import models_json_schema

from gateway.anthropic import schema as anthropic
from gateway.http.openapi_extensions import (
    REF,
    admin_paths,
    batch_paths,
    extension_paths,
    messages_paths,
)
from gateway.http.websocket import MAX_REQUESTS_PER_SOCKET
from gateway.openai.schema import admin, websocket
from gateway.openai.schema.json_schema import (
    REF_TEMPLATE,
    OpenAPISchema,
    components,
    with_model_names,
)

WS_DESCRIPTION = f"""\
Upgrade to a WebSocket carrying many requests at once, each named by a client-chosen `id`.

Client messages (JSON, in text or binary frames; `x-websocket-messages.client`):
- `{{"type": "request", "id": "r1", "endpoint": "chat" | "completions", "body": {{...}}}}`:
  `body` is the same object POST /v1/chat/completions or /v1/completions takes; it is always
  streamed. At most {MAX_REQUESTS_PER_SOCKET} requests in flight per socket.
- `{{"type": "cancel", "id": "r1"}}`: abort that request wherever it is (queue or worker).

Server messages (UTF-8 JSON in binary frames; `x-websocket-messages.server`):
- `{{"type": "queued", "id": "r1", "position": 3}}`: admitted and waiting in the queue.
- `{{"type": "chunk", "id": "r1", "data": <chunk>}}`: one stream chunk, exactly as the SSE
  `data:` of the matching endpoint.
- `{{"type": "done", "id": "r1", "usage": {{...}}}}`: the request finished and is billed; no
  more messages carry its id.
- `{{"type": "error", "id": "r1", "error": {{"message", "type", "param", "code"}}}}`: the request
  failed (same error object as the HTTP API; `type` "cancelled" after a cancel) and is over;
  `id` is null when the message itself could not be read.

Closing the socket cancels all its requests. Authenticate with the same
`Authorization: Bearer <key>` header on the upgrade request."""


def _errors(*statuses: int) -> dict:
    why = {400: "Invalid request (`param` names the field).", 401: "Missing or unknown API key.",
           402: "The tenant's budget is spent.", 403: "The key may not use this route.",
           404: "Not found.", 409: "Conflicts with the pool's state (the last worker), or a "
                                   "batch that has ended.",
           413: "Over a size limit.", 415: "Not the media type the route reads.",
           429: "Rate limited or queue full; see Retry-After.",
           502: "The worker could not be reached or started.",
           503: "Overloaded or not ready; see Retry-After."}
    error = {"application/json": {"schema": {"$ref": REF + "Error"}}}
    return {str(s): {"description": why[s], "content": error} for s in statuses}


def _anthropic_errors(*statuses: int) -> dict:
    """Error responses of Anthropic's routes: its body, and 529 where the gateway's is 503."""
    why = {400: "Invalid request.", 401: "Missing or unknown API key (x-api-key or Bearer).",
           402: "The tenant's budget is spent (billing_error).", 404: "Not found.",
           413: "The body is over the limit.", 429: "Rate limited or queue full; see "
                                                   "Retry-After.",
           529: "Overloaded, not ready or draining (overloaded_error); see Retry-After."}
    error = {"application/json": {"schema": {"$ref": REF + "AnthropicError"}}}
    return {str(s): {"description": why[s], "content": error} for s in statuses}


def _generate(summary: str, request: str, response: str, chunk: str) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF + request}}}},
        "responses": {
            "200": {"description": "The completion, or with stream: true an event stream.",
                    "content": {"application/json": {"schema": {"$ref": REF + response}},
                                "text/event-stream": {
                                    "schema": {"type": "string",
                                               "description": f"`data: <{chunk}>` events, "
                                                              "then `data: [DONE]`."}}}},
            **_errors(400, 401, 402, 429, 503)}}}


def _json(schema: str, description: str = "OK") -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": REF + schema}}}}


def _websocket() -> dict:
    def refs(names) -> list[dict]:
        return [{"$ref": REF + name} for name in names]
    return {"get": {
        "summary": "WebSocket API", "description": WS_DESCRIPTION,
        "security": [{"bearer": []}],
        "x-websocket-messages": {"client": {"oneOf": refs(websocket.CLIENT_MESSAGES)},
                                 "server": {"oneOf": refs(websocket.SERVER_MESSAGES)}},
        "responses": {"101": {"description": "Switching protocols"}, **_errors(401)}}}


def _typed(types: dict[str, Any],
           mode: Literal["validation", "serialization"]) -> dict[str, dict]:
    """Component schemas of TypedDicts (and unions of them), by name, with their `$defs`."""
    out: dict[str, dict] = {}
    for name, kind in types.items():
        schema = TypeAdapter(kind).json_schema(ref_template=REF_TEMPLATE,
                                               schema_generator=OpenAPISchema, mode=mode)
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    return out


def _models(models: tuple) -> dict[str, dict]:
    """Component schemas of request models, by name, with their `$defs`."""
    _, schemas = models_json_schema([(m, "validation") for m in models],
                                    ref_template=REF_TEMPLATE, schema_generator=OpenAPISchema)
    return schemas.get("$defs", {})


@cache
def _components() -> dict[str, dict]:
    schemas = components()
    extra = {**_typed(admin.COMPONENTS, "serialization"),
             **_typed(websocket.CLIENT_MESSAGES, "validation"),
             **_typed(websocket.SERVER_MESSAGES, "serialization"),
             **_models(anthropic.REQUESTS), **_typed(anthropic.COMPONENTS, "serialization")}
    for name, schema in extra.items():
        # a shared $def (Usage, ChatCompletionRequest, ...) keeps the main document's version
        schemas.setdefault(name, schema)
    return schemas


def _anthropic_model_names(schemas: dict[str, dict]) -> dict[str, dict]:
    """The Messages bodies' `model` as the served names, as the OpenAI bodies' (whose
    enum `with_model_names` wrote)."""
    model = schemas["ChatCompletionRequest"]["properties"]["model"]
    for request in anthropic.REQUESTS:
        schema = schemas[request.__name__]
        schemas[request.__name__] = {**schema, "properties": {**schema["properties"],
                                                              "model": model}}
    return schemas


def build_openapi(model_names: str | tuple[str, ...]) -> dict:
    """The whole document, naming the served model (its first name, and every alias)."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    model_name = names[0]
    return {
        "openapi": "3.1.0",
        "info": {"title": "inferstack gateway", "version": "1",
                 "description": f"OpenAI-compatible API serving `{model_name}`."},
        "paths": {
            "/v1/chat/completions": _generate("Chat completion", "ChatCompletionRequest",
                                              "ChatCompletion", "ChatCompletionChunk"),
            "/v1/completions": _generate("Text completion", "CompletionRequest", "Completion",
                                         "Completion"),
            "/v1/models": {"get": {
                "summary": "The served models", "security": [{"bearer": []}],
                "responses": {"200": _json("ModelList"), **_errors(401)}}},
            "/v1/ws": _websocket(),
            "/health": {"get": {"summary": "Liveness: the process answers",
                                "responses": {"200": _json("Health")}}},
            "/ready": {"get": {
                "summary": "Readiness: a runtime worker can take requests",
                "description": "No key needed (load balancers poll it); `worker_pids` only "
                               "for admin keys.",
                "responses": {"200": _json("Readiness", "Ready"),
                              "503": _json("Readiness", "Not ready yet, or draining")}}},
            "/metrics": {"get": {
                "summary": "Prometheus metrics (admin keys and keys with metrics = true)",
                "security": [{"bearer": []}],
                "responses": {"200": {"description": "OK", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}, **_errors(401, 403)}}},
            "/openapi.json": {"get": {
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.1", "content": {
                    "application/json": {"schema": {"type": "object"}}}}}}},
            **extension_paths(_errors),
            **messages_paths(_anthropic_errors),
            **admin_paths(_errors),
            **batch_paths(_errors),
        },
        "components": {"schemas": _anthropic_model_names(with_model_names(_components(),
                                                                          names)),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x-api-key": {"type": "apiKey", "in": "header",
                                                         "name": "x-api-key"}}},
    }
