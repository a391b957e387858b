"""The OpenAPI paths beyond OpenAI's chat and completions: vLLM's `/tokenize` and
`/detokenize`, and the Responses API (`/v1/responses`); their schemas are generated from
gateway/openai/schema/ like every other."""
from __future__ import annotations

REF = "#/components/schemas/"


def _json_body(schema: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF + schema}}}}


def _ok(schema: str, errors: dict, stream: str | None = None) -> dict:
    content = {"application/json": {"schema": {"$ref": REF + schema}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": stream}}
    return {"200": {"description": "OK", "content": content}, **errors}


def extension_paths(errors) -> dict:
    """`errors(*statuses)` builds the error responses, shared with the main document."""
    secured: dict = {"security": [{"bearer": []}]}
    return {
        "/tokenize": {"post": {**secured, "summary": "Tokenize a prompt or a chat (vLLM)",
                               "requestBody": _json_body("TokenizeRequest"),
                               "responses": _ok("TokenizeResponse", errors(400, 401, 404, 429,
                                                                           503))}},
        "/detokenize": {"post": {**secured, "summary": "Token ids back to text (vLLM)",
                                 "requestBody": _json_body("DetokenizeRequest"),
                                 "responses": _ok("DetokenizeResponse",
                                                  errors(400, 401, 404, 429, 503))}},
        "/v1/responses": {"post": {
            **secured, "summary": "Create a response (OpenAI's Responses API)",
            "requestBody": _json_body("ResponsesRequest"),
            "responses": _ok("Response", errors(400, 401, 402, 404, 429, 503),
                             "`event: <type>` and `data: <event>` with sequence numbers.")}},
        "/v1/responses/{response_id}": {
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "get": {**secured, "summary": "A stored response",
                    "responses": _ok("Response", errors(401, 404))},
            "delete": {**secured, "summary": "Delete a stored response",
                       "responses": {"200": {"description": "Deleted"}, **errors(401, 404)}}},
    }
