"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

A Responses request is a chat request in another shape: it is parsed into one, admitted,
queued, metered, settled and written to the ledger by the very path /v1/chat/completions
takes (`admit`, the in-flight record, the accounting), under the same stream guard. Only the
answer differs: a Response object, or its typed events over SSE with `event:` lines. Its id
(resp_...) is the request's id everywhere: the ledger row, the trace and x-request-id.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from billing.keys import ApiKey
from gateway.errors import APIError, bad_request
from gateway.http.auth import authenticate
from gateway.http.completions import (
    InterTokenClock,
    StreamGuard,
    reasoning_split_of,
    response_headers,
    usage_of,
)
from gateway.http.error_middleware import json_response
from gateway.http.named_events import NamedEventStream, encode
from gateway.http.request_body import generation, trace_context, validate
from gateway.openai.reasoning import ReasoningSplit
from gateway.openai.reasoning import split_piece as split_reasoning
from gateway.openai.requests import GenerationRequest, parse_chat_request
from gateway.openai.responses_api import (
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    new_response_id,
    parse_responses_request,
    response_shell,
    responses_usage,
    status_of,
)
from gateway.serving.accounting import wait_committed
from gateway.serving.admission import admit
from gateway.serving.inflight import InFlightRequest
from gateway.state import STATE, GatewayState


def chat_request(state: GatewayState, chat_body: dict) -> GenerationRequest:
    """The one call into the chat parser: its sampling checks and the model's sampling
    defaults apply unchanged."""
    return parse_chat_request(chat_body, state.sampling_defaults)


@dataclass
class Turn:
    """One Responses request on its way: what it asked, the conversation it continues and
    the shell of its answer."""

    state: GatewayState
    tenant: str
    req: ResponsesRequest
    history: tuple[dict, ...]  # the stored conversation of previous_response_id
    shell: ResponseShell

    def finish(self, gen: InFlightRequest, text: str, reasoning: str | None = None) -> dict:
        """The final Response object; stored (when asked) before the client sees it, so the
        client may chain the next request on it at once. The stored conversation keeps the
        answer, not its thought (reasoning templates drop earlier thoughts anyway)."""
        usage = responses_usage(usage_of(gen))
        response = self.shell.build(status_of(gen.finish_reasons.get(0)), text, usage,
                                    reasoning=reasoning)
        if response["store"]:
            answer = {"role": "assistant", "content": text}
            self.state.response_store.put(self.tenant, response,
                                          (*self.history, *self.req.messages, answer))
        return response


async def admit_turn(request: web.Request, state: GatewayState, key: ApiKey, body):
    """Parse, continue the stored conversation and admit: a refusal names the Responses
    param it came from. A large body's parse and its chat body's run off the event loop."""
    req = await validate(request, body, parse_responses_request)
    history = state.response_store.history(key.tenant.name, req.previous_response_id)
    response_id = new_response_id()
    trace = trace_context(request)
    if req.reasoning_effort not in (None, "none") and state.reasoning_parser() == "none":
        raise bad_request(f"reasoning.effort {req.reasoning_effort!r:.60} cannot be honoured: "
                          "this model does not reason", "reasoning.effort",
                          code="unsupported_parameter")
    try:
        chat = await validate(request, req.chat_body(history),
                              functools.partial(chat_request, state))
        gen = await admit(state, key, chat, body, trace, request_id=response_id)
    except APIError as exc:
        raise req.renamed(exc, len(history)) from None
    stored = req.store and state.response_store.enabled
    shell = response_shell(response_id, req, chat, state.model_name, stored)
    return Turn(state, key.tenant.name, req, history, shell), gen


async def create_response(request: web.Request):
    async with generation(request) as (state, key, body):
        turn, gen = await admit_turn(request, state, key, body)
        if turn.req.stream:
            return await ResponseStream(request, turn, gen).run()
        return await respond_json(turn, gen)


class Thoughts:
    """A response's output split into its thought and its answer, as it comes (one choice),
    counting the reasoning tokens its usage reports."""

    def __init__(self, state: GatewayState, gen: InFlightRequest):
        self.split: ReasoningSplit | None = reasoning_split_of(state, gen)
        self.gen = gen  # counts the reasoning tokens its usage reports
        self.texts: list[str] = []
        self.thoughts: list[str] = []

    def feed(self, delta) -> tuple[str, str]:
        """(new reasoning, new content) of one delta."""
        if self.split is None:
            self.texts.append(delta.text)
            return "", delta.text
        thought, said, inside = split_reasoning(self.split, delta.text,
                                                delta.finish_reason is not None)
        self.gen.reasoning_tokens += len(delta.token_ids) if inside else 0
        self.thoughts.append(thought)
        self.texts.append(said)
        return thought, said

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str | None:
        return "".join(self.thoughts) or None


async def respond_json(turn: Turn, gen: InFlightRequest) -> web.Response:
    thoughts = Thoughts(turn.state, gen)
    async with aclosing(turn.state.service.stream(gen)) as deltas:  # aborted at once if cancelled
        async for delta in deltas:
            thoughts.feed(delta)
    await wait_committed(gen)  # the bill is durable before the client sees the answer
    return json_response(turn.finish(gen, thoughts.text, thoughts.reasoning),
                         headers=response_headers(gen))


class ResponseStream(NamedEventStream):
    """One streamed response; once open, an error becomes an `error` event and
    response.failed."""

    def __init__(self, request: web.Request, turn: Turn, gen: InFlightRequest):
        self.turn = turn
        self.thoughts = Thoughts(turn.state, gen)
        self.events = ResponseEvents(turn.shell, lazy=self.thoughts.split is not None)
        super().__init__(request, turn.state, gen, self.events.opening)

    async def send(self, make: Callable[..., list[dict]], *args) -> bool:
        """Send the events `make(*args)` returns, made after the opening ones so that their
        sequence numbers follow; False when the client is gone."""
        sse = await self.open()
        return await sse.send_bytes(encode(make(*args)))

    async def keepalive(self) -> bool:
        return await (await self.open()).keepalive()

    def _failure(self, exc: APIError) -> list[dict]:
        return self.events.failed(exc, self.thoughts.text, self.thoughts.reasoning)

    async def _stream(self, guard: StreamGuard) -> None:
        itl = InterTokenClock(self.state)
        # aclosing: leaving the loop aborts the job now, not when the generator is finalized
        async with aclosing(self.state.service.stream(self.gen)) as deltas:
            async for delta in deltas:
                guard.touch()
                thought, said = self.thoughts.feed(delta)
                if thought and not await self.send(self.events.reasoning, thought):
                    return  # the client is gone: leaving the loop aborts the job
                if said and not await self.send(self.events.delta, said):
                    return
                itl.tick(len(delta.token_ids))
        text = self.thoughts.text
        status = status_of(self.gen.finish_reasons.get(0))
        if not await self.send(self.events.closing, text, status):
            return
        await wait_committed(self.gen)  # the bill is durable before the client sees it final
        await self.send(self.events.final, self.turn.finish(self.gen, text,
                                                            self.thoughts.reasoning))


async def get_response(request: web.Request):
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    if request.query.get("stream", "false") != "false":
        raise bad_request("stream is not supported here: a stored response is returned "
                          "whole", "stream")
    stored = state.response_store.get(key.tenant.name, request.match_info["response_id"])
    return json_response(stored.response)


async def delete_response(request: web.Request):
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    response_id = request.match_info["response_id"]
    state.response_store.delete(key.tenant.name, response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
