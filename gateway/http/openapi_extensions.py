"""The OpenAPI paths beyond OpenAI's chat and completions: vLLM's `/tokenize` and
`/detokenize`, the Responses API (`/v1/responses`), Anthropic's Messages API (`/v1/messages`),
and the operators' `/admin/*` routes; their
schemas are generated from gateway/openai/schema/ like every other (the admin answers from
schema/admin.py)."""
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


def messages_paths(errors) -> dict:
    """Anthropic's Messages API; `errors(*statuses)` builds its error responses (Anthropic's
    body and statuses)."""
    secured: dict = {"security": [{"x-api-key": []}, {"bearer": []}]}
    return {
        "/v1/messages": {"post": {
            **secured, "summary": "Create a message (Anthropic's Messages API)",
            "description": "Metered, billed and written to the ledger like chat; usage: "
                           "`input_tokens` are cache misses, `cache_read_input_tokens` prefix "
                           "cache hits. The `anthropic-version` header is accepted, not "
                           "required.",
            "requestBody": _json_body("MessagesRequest"),
            "responses": _ok("Message", errors(400, 401, 402, 404, 413, 429, 529),
                             "`event: <type>` and `data: <event>`: message_start, ping, "
                             "content_block_start/delta/stop, message_delta, message_stop; "
                             "`error` on a failure after the stream opened.")}},
        "/v1/messages/count_tokens": {"post": {
            **secured, "summary": "Count a message's input tokens (Anthropic's)",
            "requestBody": _json_body("CountTokensRequest"),
            "responses": _ok("TokenCount", errors(400, 401, 404, 413, 429, 529))}},
    }


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


def _telemetry(errors) -> dict:
    return {"get": {
        "summary": "The live telemetry feed (admin keys): a WebSocket",
        "description": "Upgrade to a WebSocket on which the gateway pushes JSON text frames: "
                       "`hello` once, a `snapshot` every second, and spans as requests end "
                       "(docs/telemetry_feed.md has every frame). The client only listens; "
                       "one that falls behind is closed with code 1013.",
        "security": [{"bearer": []}],
        "responses": {"101": {"description": "Switching protocols"}, **errors(401, 403)}}}


def admin_paths(errors) -> dict:
    """The operators' routes: ledger totals, the live feed, the worker pool and the fleet.
    Changes need an admin key; the readings of the pool and the fleet also take a metrics key."""
    secured: dict = {"security": [{"bearer": []}]}
    period = {"type": "string", "enum": ["hour", "day", "month", "all"], "default": "day"}
    return {
        "/admin/usage": {"get": {
            **secured, "summary": "Ledger totals per tenant and period (admin keys)",
            "parameters": [
                _query("period", period, "The bucket the sums are grouped by."),
                _query("tenant", {"type": "string"}, "Only this tenant."),
                _query("since", {"type": "number"}, "From this time (unix seconds)."),
                _query("until", {"type": "number"}, "Before this time (unix seconds).")],
            "responses": _ok("UsageReport", errors(400, 401, 403))}},
        "/admin/telemetry": _telemetry(errors),
        "/admin/workers": {
            "get": {**secured, "summary": "The worker pool (admin or metrics keys)",
                    "responses": _ok("WorkerList", errors(401, 403))},
            "post": {**secured,
                     "summary": "Connect a shared worker by URL, or spawn a local one",
                     "requestBody": _json_body("AddWorkerRequest"),
                     "responses": {"201": {"description": "The worker, connected and ready",
                                           "content": {"application/json": {"schema": {
                                               "$ref": REF + "Worker"}}}},
                                   **errors(400, 401, 403, 409, 502)}}},
        "/admin/workers/{index}": {
            "parameters": [{"name": "index", "in": "path", "required": True,
                            "schema": {"type": "integer", "minimum": 0}}],
            "delete": {
                **secured, "summary": "Drain a worker, then remove it (admin keys)",
                "description": "It takes no new requests; the running ones finish and are "
                               "billed (aborted after --worker-drain-seconds). 202 at once, "
                               "or with `?wait=true` 200 once it is gone. The last worker "
                               "cannot be removed (409).",
                "parameters": [_query("wait", {"type": "string", "enum": ["1", "true"]},
                                      "Answer once the worker is gone.")],
                "responses": {
                    "200": {"description": "Removed", "content": {"application/json": {
                        "schema": {"$ref": REF + "RemovedWorker"}}}},
                    "202": {"description": "Draining", "content": {"application/json": {
                        "schema": {"$ref": REF + "RemovedWorker"}}}},
                    **errors(400, 401, 403, 404, 409)}}},
        "/admin/fleet": {"get": {
            **secured, "summary": "Every live gateway and worker, and fleet revenue "
                                  "(admin or metrics keys)",
            "responses": _ok("Fleet", errors(401, 403))}},
    }


def _inline(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path_param(name: str) -> list[dict]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


FILE_OBJECT = {"type": "object", "description": "OpenAI's File object.",
               "required": ["id", "object", "bytes", "created_at", "filename", "purpose",
                            "status"],
               "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                              "bytes": {"type": "integer"}, "created_at": {"type": "integer"},
                              "filename": {"type": "string"}, "purpose": {"type": "string"},
                              "status": {"type": "string"}}}
BATCH_OBJECT = {"type": "object", "description": "OpenAI's Batch object: status, timestamps, "
                "request_counts {total, completed, failed}, output and error file ids.",
                "required": ["id", "object", "endpoint", "input_file_id", "completion_window",
                             "status", "created_at", "request_counts"],
                "properties": {"id": {"type": "string"}, "object": {"const": "batch"},
                               "status": {"type": "string", "enum": [
                                   "validating", "in_progress", "finalizing", "completed",
                                   "failed", "expired", "cancelling", "cancelled"]}}}


def _listed(item: dict) -> dict:
    return {"type": "object", "properties": {"object": {"const": "list"},
                                             "data": {"type": "array", "items": item},
                                             "has_more": {"type": "boolean"}}}


def batch_paths(errors) -> dict:
    """OpenAI's Files and Batch API (gateway/http/files_route.py, batches_route.py)."""
    secured: dict = {"security": [{"bearer": []}]}
    page = [{"name": "limit", "in": "query", "schema": {"type": "integer"}},
            {"name": "after", "in": "query", "schema": {"type": "string"}}]
    upload = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"const": "batch"}}}}}}
    create = {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
        "properties": {"input_file_id": {"type": "string"},
                       "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions",
                                             "/v1/responses"]},
                       "completion_window": {"const": "24h"},
                       "metadata": {"type": "object"}}}}}}
    return {
        "/v1/files": {
            "post": {**secured, "summary": "Upload a batch input file (JSONL)",
                     "requestBody": upload,
                     "responses": {"200": _inline(FILE_OBJECT), **errors(400, 401, 413, 415)}},
            "get": {**secured, "summary": "This tenant's files", "parameters": page,
                    "responses": {"200": _inline(_listed(FILE_OBJECT)), **errors(400, 401)}}},
        "/v1/files/{file_id}": {
            "parameters": _path_param("file_id"),
            "get": {**secured, "summary": "A file",
                    "responses": {"200": _inline(FILE_OBJECT), **errors(401, 404)}},
            "delete": {**secured, "summary": "Delete a file",
                       "responses": {"200": {"description": "Deleted"}, **errors(401, 404)}}},
        "/v1/files/{file_id}/content": {
            "parameters": _path_param("file_id"),
            "get": {**secured, "summary": "A file's bytes (input, output or error JSONL)",
                    "responses": {"200": {"description": "The file", "content": {
                        "application/octet-stream": {"schema": {"type": "string"}}}},
                        **errors(401, 404)}}},
        "/v1/batches": {
            "post": {**secured, "summary": "Create a batch (run in idle capacity)",
                     "requestBody": create,
                     "responses": {"200": _inline(BATCH_OBJECT), **errors(400, 401, 404, 429)}},
            "get": {**secured, "summary": "This tenant's batches", "parameters": page,
                    "responses": {"200": _inline(_listed(BATCH_OBJECT)), **errors(400, 401)}}},
        "/v1/batches/{batch_id}": {
            "parameters": _path_param("batch_id"),
            "get": {**secured, "summary": "A batch",
                    "responses": {"200": _inline(BATCH_OBJECT), **errors(401, 404)}}},
        "/v1/batches/{batch_id}/cancel": {
            "parameters": _path_param("batch_id"),
            "post": {**secured, "summary": "Cancel a batch",
                     "responses": {"200": _inline(BATCH_OBJECT), **errors(401, 404, 409)}}},
    }
