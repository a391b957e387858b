"""The OpenAPI paths beyond OpenAI's chat and completions: vLLM's `/tokenize` and
`/detokenize`, and the Responses API (`/v1/responses`), with their schemas."""
from __future__ import annotations

from gateway.openai.requests import MAX_MESSAGES

REF = "#/components/schemas/"


def _json_body(schema: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF + schema}}}}


def _ok(schema: str, errors: dict, stream: str | None = None) -> dict:
    content = {"application/json": {"schema": {"$ref": REF + schema}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": stream}}
    return {"200": {"description": "OK", "content": content}, **errors}


def extension_schemas(model: dict) -> dict:
    """`model`: the schema of the model field (the served names), shared with the main one."""
    text = {"type": "string"}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                              "content": {"oneOf": [text, {"type": "array"}]}}}
    return {
        "TokenizeRequest": {"type": "object", "properties": {
            "model": model, "prompt": text,
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                         "items": message},
            "add_special_tokens": {"type": "boolean", "default": False},
            "add_generation_prompt": {"type": "boolean", "default": True},
            "return_token_strs": {"type": "boolean", "default": False}},
            "description": "Exactly one of prompt or messages."},
        "TokenizeResponse": {"type": "object", "properties": {
            "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": ["array", "null"], "items": text}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": model,
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "DetokenizeResponse": {"type": "object", "properties": {"prompt": text}},
        "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
            "model": model,
            "input": {"oneOf": [text, {"type": "array", "maxItems": MAX_MESSAGES,
                                       "items": message}]},
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
            "top_p": {"type": ["number", "null"]},
            "stream": {"type": ["boolean", "null"]}, "store": {"type": ["boolean", "null"]},
            "previous_response_id": {"type": ["string", "null"]},
            "metadata": {"type": ["object", "null"]}, "user": {"type": ["string", "null"]}}},
        "Response": {"type": "object", "properties": {
            "id": text, "object": {"const": "response"}, "status": text,
            "output": {"type": "array"}, "usage": {"type": "object"}}},
    }


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
