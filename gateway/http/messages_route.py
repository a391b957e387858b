"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API.

A Messages request is a chat request in another shape, as a Responses request is: it is read
into a chat body (gateway/anthropic/messages_api.py), parsed by the chat parser, admitted,
queued, metered, settled and written to the ledger by the very path /v1/chat/completions takes
(`admit`, the in-flight record, the accounting), under the same stream guard. Only the answer
differs: a Message object, or Anthropic's named SSE events, with the gateway's keep-alive sent
as Anthropic's `ping` event. Its id (msg_...) is the request's id everywhere: the ledger row,
the trace and x-request-id. Every error on these routes is Anthropic's body and status (the
error middleware translates the gateway's APIError there); one after the stream opened is an
`event: error`.
"""
from __future__ import annotations

import functools
from contextlib import aclosing

from aiohttp import web

from billing.keys import ApiKey
from gateway.anthropic.errors import error_event
from gateway.anthropic.messages_api import (
    MessageEvents,
    MessagesCall,
    content_blocks,
    matched_stop,
    message,
    message_shell,
    message_usage,
    new_message_id,
    parse_count_tokens_request,
    parse_messages_request,
    stop_reason,
    tool_reader,
)
from gateway.errors import APIError
from gateway.http.auth import authenticate
from gateway.http.completions import InterTokenClock, StreamGuard, response_headers, usage_of
from gateway.http.error_middleware import json_response
from gateway.http.named_events import NamedEventStream
from gateway.http.request_body import generation, read_json, trace_context, validate
from gateway.openai.reasoning import ReasoningSplit, prompt_opens_think, reasoning_split_for
from gateway.openai.requests import GenerationRequest, parse_chat_request
from gateway.serving.accounting import wait_committed
from gateway.serving.admission import admit, check_model
from gateway.serving.inflight import InFlightRequest
from gateway.state import STATE, GatewayState


def chat_request(state: GatewayState, chat_body: dict) -> GenerationRequest:
    """The one call into the chat parser: its checks and the model's sampling defaults."""
    return parse_chat_request(chat_body, state.sampling_defaults)


class Turn:
    """One Messages request on its way: what it asked, its record and its answer's shell."""

    def __init__(self, state: GatewayState, call: MessagesCall, gen: InFlightRequest):
        self.state, self.call, self.gen = state, call, gen
        self.shell = message_shell(gen.request_id, state.model_name)
        self.texts: list[str] = []
        self.tokens: list[int] = []

    def reader(self):
        """Chat's tool reader for this request's output (None: plain text)."""
        return tool_reader(self.gen.request.tools, self.state.tool_call_parser())

    def split(self) -> ReasoningSplit | None:
        """Chat's reasoning splitter for this request's output (None: the model does not
        think in the open)."""
        return reasoning_split_for(self.state.reasoning_parser(),
                                   prompt_opens_think(self.gen.prompt_text))

    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer, found in the text of all its tokens."""
        stops = self.call.stop_sequences
        if not stops or self.gen.finish_reasons.get(0) != "stop":
            return None
        service = self.state.service
        assert service is not None  # admitted: a worker was up
        return matched_stop(service.detokenize(tuple(self.tokens)), "".join(self.texts), stops)


async def admit_turn(request: web.Request, state: GatewayState, key: ApiKey, body) -> Turn:
    """Parse, translate and admit; a chat-side refusal names the Messages param it came from.
    A large body's parse and its chat body's run off the event loop."""
    call = await validate(request, body, parse_messages_request)
    try:
        chat = await validate(request, call.chat, functools.partial(chat_request, state))
        gen = await admit(state, key, chat, body, trace_context(request),
                          request_id=new_message_id())
    except APIError as exc:
        raise call.renamed(exc) from None
    return Turn(state, call, gen)


async def create_message(request: web.Request):
    async with generation(request) as (state, key, body):
        turn = await admit_turn(request, state, key, body)
        if turn.call.stream:
            return await MessageStream(request, turn).run()
        return await respond_json(turn)


async def respond_json(turn: Turn) -> web.Response:
    gen = turn.gen
    async with aclosing(turn.state.service.stream(gen)) as deltas:  # aborted if cancelled
        async for delta in deltas:
            turn.texts.append(delta.text)
            turn.tokens.extend(delta.token_ids)
    await wait_committed(gen)  # the bill is durable before the client sees the answer
    blocks = content_blocks("".join(turn.texts), turn.reader(), turn.split())
    stop_sequence = turn.stop_sequence()
    called = any(b["type"] == "tool_use" for b in blocks)
    reason = stop_reason(gen.finish_reasons.get(0), called, stop_sequence)
    body = message(turn.shell, blocks, reason,
                   stop_sequence if reason == "stop_sequence" else None,
                   message_usage(usage_of(gen)))
    return json_response(body, headers=response_headers(gen))


class MessageStream(NamedEventStream):
    """One streamed message; once open, an error becomes an `error` event."""

    def __init__(self, request: web.Request, turn: Turn):
        self.turn = turn
        self.events = MessageEvents(turn.shell, turn.reader(), len(turn.gen.prompt),
                                    turn.split())
        super().__init__(request, turn.state, turn.gen, self.events.opening)

    async def send(self, events: list[dict]) -> bool:
        return await self.send_events(events)

    async def keepalive(self) -> bool:
        return await self.send([{"type": "ping"}])  # Anthropic's keep-alive

    def _failure(self, exc: APIError) -> list[dict]:
        return [error_event(exc)]

    async def _stream(self, guard: StreamGuard) -> None:
        itl = InterTokenClock(self.state)
        turn = self.turn
        # aclosing: leaving the loop aborts the job now, not when the generator is finalized
        async with aclosing(self.state.service.stream(self.gen)) as deltas:
            async for delta in deltas:
                guard.touch()
                turn.texts.append(delta.text)
                turn.tokens.extend(delta.token_ids)
                if not await self.send(self.events.delta(delta.text) if delta.text else []):
                    return  # the client is gone: leaving the loop aborts the job
                itl.tick(len(delta.token_ids))
        stop_sequence = turn.stop_sequence()
        await wait_committed(self.gen)  # the bill is durable before the client sees it final
        await self.send(self.events.closing(self.gen.finish_reasons.get(0), stop_sequence,
                                            message_usage(usage_of(self.gen))))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages renders it (system, messages and tools through the
    same template): what a request with this body is billed as input, cache hits included.
    Counts against the tenant's requests per minute like /tokenize; nothing is billed."""
    state = request.app[STATE]
    key = authenticate(request, state.keys)
    service = state.require_service()  # the tokenizer arrives with the first worker
    await state.accounting.take_request(key)  # first: a refused body costs a request too
    body = await read_json(request, state.config.body_timeout_seconds)
    call = await validate(request, body, parse_count_tokens_request)
    try:
        chat = await validate(request, call.chat, functools.partial(chat_request, state))
        check_model(state, key.tenant, chat.model)
        ids = await service.tokenize(chat)
    except APIError as exc:
        raise call.renamed(exc) from None
    return json_response({"input_tokens": len(ids)})


def add_messages_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
