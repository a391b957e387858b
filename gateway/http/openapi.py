"""The OpenAPI 3.1 document of the gateway's HTTP and WebSocket API.

Only the paths, their operations and the WebSocket's description are written here: every
component schema is generated from the declarations the gateway validates and answers with
(gateway/openai/schema/), so the document cannot drift from what is accepted or sent. The
components are generated once per process; the served names are filled in per document.
"""
from __future__ import annotations

from functools import cache

from gateway.http.openapi_extensions import REF, extension_paths
from gateway.openai.schema.json_schema import components, with_model_names

WS_DESCRIPTION = """\
Upgrade to a WebSocket carrying many requests at once, each named by a client-chosen `id`.

Client messages (JSON text frames):
- `{"type": "request", "id": "r1", "endpoint": "chat" | "completions", "body": {...}}`:
  `body` is the same object POST /v1/chat/completions or /v1/completions takes; it is always
  streamed.
- `{"type": "cancel", "id": "r1"}`: abort that request wherever it is (queue or GPU).

Server messages:
- `{"type": "queued", "id": "r1", "position": 3}`: admitted and waiting in the queue.
- `{"type": "chunk", "id": "r1", "data": <chunk>}`: one stream chunk, exactly as the SSE
  `data:` of the matching endpoint.
- `{"type": "done", "id": "r1"}`: the request finished; no more messages carry its id.
- `{"type": "error", "id": "r1", "error": {"message", "type", "param", "code"}}`: the request
  failed (same error object as the HTTP API) and is over.

Authenticate with the same `Authorization: Bearer <key>` header on the upgrade request."""


def _errors(*statuses: int) -> dict:
    why = {400: "Invalid request (`param` names the field).", 401: "Missing or unknown API key.",
           402: "The tenant's budget is spent.", 404: "Not found.",
           429: "Rate limited or queue full; see Retry-After.",
           503: "Overloaded or not ready; see Retry-After."}
    error = {"application/json": {"schema": {"$ref": REF + "Error"}}}
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


def _plain_get(summary: str, content_type: str, schema: dict) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {
        "description": "OK", "content": {content_type: {"schema": schema}}}}}}


@cache
def _components() -> dict[str, dict]:
    return components()


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
                "responses": {"200": {"description": "OK", "content": {"application/json": {
                    "schema": {"$ref": REF + "ModelList"}}}}, **_errors(401)}}},
            "/v1/ws": {"get": {"summary": "WebSocket API", "description": WS_DESCRIPTION,
                               "security": [{"bearer": []}],
                               "responses": {"101": {"description": "Switching protocols"},
                                             **_errors(401)}}},
            "/health": _plain_get("Liveness: the process answers", "application/json",
                                  {"type": "object", "properties": {"status": {
                                      "const": "ok"}}}),
            "/ready": {"get": {"summary": "Readiness: a runtime worker can take requests",
                               "responses": {"200": {"description": "Ready"}, **_errors(503)}}},
            "/metrics": _plain_get("Prometheus metrics", "text/plain", {"type": "string"}),
            **extension_paths(_errors),
        },
        "components": {"schemas": with_model_names(_components(), names),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
