"""The OpenAPI 3.1 document of the gateway's HTTP and WebSocket API.

Ranges and enums come from the validator's own constants, so the document cannot drift from what
`gateway.openai.requests` accepts.
"""
from __future__ import annotations

from contract.sampling_params import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
)
from gateway.http import openapi_tools
from gateway.http.openapi_extensions import REF, extension_paths, extension_schemas
from gateway.openai.requests import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PRIORITY,
    MAX_TEMPERATURE,
    MIN_PRIORITY,
    ROLES,
)

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


def _int(lo=None, hi=None, desc=None, default=None, nullable=True) -> dict:
    return _scalar("integer", lo, hi, desc, default, nullable)


def _num(lo=None, hi=None, desc=None, default=None, nullable=True) -> dict:
    return _scalar("number", lo, hi, desc, default, nullable)


def _scalar(kind, lo, hi, desc, default, nullable) -> dict:
    schema: dict = {"type": [kind, "null"] if nullable else kind}
    for key, value in (("minimum", lo), ("maximum", hi), ("description", desc),
                       ("default", default)):
        if value is not None:
            schema[key] = value
    return schema


def _bool(desc, default=False) -> dict:
    return {"type": ["boolean", "null"], "default": default, "description": desc}


def _obj(props: dict, required=(), desc=None) -> dict:
    schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(required)
    if desc:
        schema["description"] = desc
    return schema


def _shared_request_fields(names: tuple[str, ...]) -> dict:
    """Fields both endpoints accept, as `gateway.openai.requests` validates them."""
    return {
        "model": _model(names),
        "max_tokens": _int(1, desc="Output budget; default: the rest of the context."),
        "temperature": _num(0, MAX_TEMPERATURE, "0 means greedy.", 1.0),
        "top_p": _num(0, 1, "In (0, 1].", 1.0),
        "top_k": _int(-1, desc="0 or -1 disables.", default=0),
        "min_p": _num(0, 1, default=0.0),
        "seed": _int(MIN_SEED, MAX_SEED, "Makes a sampled output reproducible."),
        "presence_penalty": _num(-2, 2, default=0.0),
        "frequency_penalty": _num(-2, 2, default=0.0),
        "repetition_penalty": _num(0, 10, "In (0, 10]; 1 disables.", 1.0),
        "stop": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP_STRINGS,
                            "items": {"type": "string", "minLength": 1}},
                           {"type": "null"}]},
        "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                           "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": _bool("Keep generating past the end-of-sequence token."),
        "n": _int(1, MAX_N, "Choices to generate.", 1),
        "stream": _bool("Stream server-sent events, ending with `data: [DONE]`."),
        "stream_options": {"type": ["object", "null"], "description": "Only with stream.",
                           "properties": {"include_usage": {"type": "boolean"}}},
        "priority": _int(MIN_PRIORITY, MAX_PRIORITY, "Lower is served first.", 0),
        "user": {"type": ["string", "null"]},
        **openapi_tools.request_fields(),
    }


PROMPT_LOGPROBS = _int(0, MAX_TOP_LOGPROBS, "vLLM's: each prompt token's logprob, rank and this "
                       "many alternatives; not with stream; the prefix cache serves none.")


def _model(names: tuple[str, ...]) -> dict:
    return {"enum": [*names, None], "description": "A served name (any other is 404 "
                                                   "model_not_found); omitted: the first."}


def _chat_request(names: tuple[str, ...]) -> dict:
    part = _obj({"type": {"const": "text"}, "text": {"type": "string"}}, ("type", "text"))
    message = _obj({"role": {"enum": list(ROLES)},
                    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part,
                                           "maxItems": MAX_CONTENT_PARTS},
                                          {"type": "null", "description": "assistant only"}]},
                    **openapi_tools.message_fields()},
                   ("role", "content"))
    return _obj({
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                     "items": message},
        **_shared_request_fields(names),
        "max_completion_tokens": _int(1, desc="Wins over max_tokens."),
        "logprobs": _bool("Return each output token's log-probability."),
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS, "Alternatives per token; needs logprobs.", 0),
        "prompt_logprobs": PROMPT_LOGPROBS,
        **openapi_tools.chat_fields(),
    }, ("messages",))


def _completion_request(names: tuple[str, ...]) -> dict:
    return _obj({
        "prompt": {"oneOf": [{"type": "string"},
                             {"type": "array", "minItems": 1,
                              "items": {"type": "integer", "minimum": 0}},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"type": "string"}}]},
        **_shared_request_fields(names),
        "logprobs": _int(0, MAX_TOP_LOGPROBS, "Log-probabilities plus this many alternatives."),
        "echo": _bool("Prepend the prompt to the output."),
        "prompt_logprobs": PROMPT_LOGPROBS,
    }, ("prompt",))


def _schemas(names: tuple[str, ...]) -> dict:
    nullable_str = {"type": ["string", "null"]}
    common = {"id": {"type": "string"}, "created": {"type": "integer"},
              "model": {"type": "string"}}
    finish = {"enum": ["stop", "length", None]}
    chat_finish = {"enum": ["stop", "length", "tool_calls", None],
                   "description": "tool_calls: the choice called tools and ended by itself."}
    content = {"type": ["string", "null"], "description": "null when only tools were called"}

    def tool_calls(item: str) -> dict:
        return {"type": "array", "items": {"$ref": REF + item}}

    chat_choice = _obj({"index": {"type": "integer"},
                        "message": _obj({"role": {"const": "assistant"}, "content": content,
                                         "tool_calls": tool_calls("ToolCall")}),
                        "logprobs": {"type": ["object", "null"]}, "finish_reason": chat_finish})
    chunk_choice = _obj({"index": {"type": "integer"},
                         "delta": _obj({"role": {"const": "assistant"}, "content": content,
                                        "tool_calls": tool_calls("ToolCallDelta")}),
                         "logprobs": {"type": ["object", "null"]}, "finish_reason": chat_finish})
    text_choice = _obj({"index": {"type": "integer"}, "text": {"type": "string"},
                        "logprobs": {"type": ["object", "null"]}, "finish_reason": finish})
    usage_ref = {"$ref": REF + "Usage"}

    def response(obj_name, choice):
        return _obj({**common, "object": {"const": obj_name},
                     "choices": {"type": "array", "items": choice}, "usage": usage_ref})

    return {
        "ChatCompletionRequest": _chat_request(names),
        "CompletionRequest": _completion_request(names),
        "Usage": _obj({
            "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": _obj({"cached_tokens": {
                "type": "integer", "description": "Prompt tokens served from the prefix cache "
                                                  "(billed at the cache-hit price)."}})}),
        "ChatCompletion": response("chat.completion", chat_choice),
        "ChatCompletionChunk": _obj({**common, "object": {"const": "chat.completion.chunk"},
                                     "choices": {"type": "array", "items": chunk_choice},
                                     "usage": {"oneOf": [usage_ref, {"type": "null"}]}}),
        "Completion": response("text_completion", text_choice),
        "Error": _obj({"error": _obj({"message": {"type": "string"}, "type": {"type": "string"},
                                      "param": nullable_str, "code": nullable_str},
                                     ("message", "type", "param", "code"))}, ("error",)),
    }


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
                    "schema": _obj({"object": {"const": "list"}, "data": {
                        "type": "array", "items": _obj({"id": {"enum": list(names)},
                                                        "object": {"const": "model"},
                                                        "created": {"type": "integer"},
                                                        "owned_by": {"type": "string"}})}})}}},
                              **_errors(401)}}},
            "/v1/ws": {"get": {"summary": "WebSocket API", "description": WS_DESCRIPTION,
                               "security": [{"bearer": []}],
                               "responses": {"101": {"description": "Switching protocols"},
                                             **_errors(401)}}},
            "/health": _plain_get("Liveness: the process answers", "application/json",
                                  {"type": "object"}),
            "/ready": {"get": {"summary": "Readiness: a runtime worker can take requests",
                               "responses": {"200": {"description": "Ready"}, **_errors(503)}}},
            "/metrics": _plain_get("Prometheus metrics", "text/plain", {"type": "string"}),
            **extension_paths(_errors),
        },
        "components": {"schemas": {**_schemas(names), **extension_schemas(_model(names)),
                                   **openapi_tools.schemas()},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
