"""The messages of the WebSocket API (GET /v1/ws), both ways, declared as TypedDicts for
/openapi.json and the README: OpenAPI describes no WebSocket messages, so the document lists
these under the path's `x-websocket-messages` and its components hold their schemas.

gateway/http/websocket.py reads and writes them as plain dicts; tests/gateway/test_openapi.py
checks a live socket's messages against these schemas.
"""
from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from gateway.openai.schema.answers import ChatCompletionChunk, Completion, ErrorDetail, Usage
from gateway.openai.schema.chat import ChatCompletionRequest, CompletionRequest

MAX_ID_CHARS = 256  # gateway/http/websocket.py refuses longer ids
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, description=(
    "Chosen by the client; unique among its requests in flight on the socket."))]
# the HTTP routes' own bodies: in the document, references to their (validation) schemas
RequestBody = Annotated[ChatCompletionRequest | CompletionRequest, Field(description=(
    "The body POST /v1/chat/completions (endpoint chat) or /v1/completions (endpoint "
    "completions) takes; `stream` is implied."))]


class WsRequest(TypedDict):
    """Start a request (at most 128 in flight per socket)."""

    type: Literal["request"]
    id: RequestId
    endpoint: NotRequired[Literal["chat", "completions"]]  # omitted: chat
    body: RequestBody


class WsCancel(TypedDict):
    """Abort a request wherever it is (queue or worker); it ends with a `cancelled` error."""

    type: Literal["cancel"]
    id: RequestId


class WsQueued(TypedDict):
    """Admitted and waiting: sent again whenever the position changes."""

    type: Literal["queued"]
    id: str
    position: int


class WsChunk(TypedDict):
    """One stream chunk, exactly the SSE `data:` of the request's endpoint."""

    type: Literal["chunk"]
    id: str
    data: ChatCompletionChunk | Completion


class WsDone(TypedDict):
    """The request finished and is billed; no later message carries its id."""

    type: Literal["done"]
    id: str
    usage: Usage


class WsError(TypedDict):
    """The request failed (`error.type` "cancelled" after a cancel) and is over; `id` is null
    when the message itself could not be read (not JSON, no valid id)."""

    type: Literal["error"]
    id: str | None
    error: ErrorDetail


# client messages are read (their schemas in validation mode, as the request bodies'), server
# messages written (in serialization mode, as the answers')
CLIENT_MESSAGES = {"WsRequest": WsRequest, "WsCancel": WsCancel}
SERVER_MESSAGES = {"WsQueued": WsQueued, "WsChunk": WsChunk, "WsDone": WsDone,
                   "WsError": WsError}
COMPONENTS = CLIENT_MESSAGES | SERVER_MESSAGES
