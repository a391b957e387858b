"""Run one prepared generation and answer it: an SSE stream or one JSON response."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import cast

from aiohttp import web

from gateway.errors import APIError
from gateway.http.error_middleware import json_response
from gateway.http.sse import SSEStream
from gateway.openai.reasoning import (
    ReasoningSplit,
    prompt_opens_think,
    reasoning_split_for,
    split_piece,
)
from gateway.openai.responses import ChoiceResult, chat_response, completion_response, usage_dict
from gateway.openai.schema.answers import Cost, FinishReason, Usage
from gateway.openai.stream_chunker import StreamChunker
from gateway.openai.tool_stream import collect, finish_reason, reader_for
from gateway.serving.accounting import wait_committed
from gateway.serving.inflight import InFlightRequest
from gateway.state import GatewayState

log = logging.getLogger(__name__)


# a request's reasoning tokens as its answer counted them (the stream's chunker, or the
# whole answer's count), read by `usage_of` wherever the usage is built (SSE, WebSocket, JSON)
def reasoning_parser_of(state: GatewayState, req) -> str | None:
    """The reasoning parser of a request's answer (chat only)."""
    return state.reasoning_parser() if req.kind == "chat" else None


def reasoning_split_of(state: GatewayState, gen: InFlightRequest) -> ReasoningSplit | None:
    """One choice's splitter. A constrained request (structured output, a required or named
    tool) thinks only where its prompt opened the block: the worker's grammar waits for the
    block to close, and holds from the first token where there is none, so the output cannot
    open one (runtime/structured/reasoning.py)."""
    parser = reasoning_parser_of(state, gen.request)
    opens = prompt_opens_think(gen.prompt_text)
    if gen.request.structured is not None and parser not in (None, "none"):
        return ReasoningSplit(starts_in_reasoning=True) if opens else None
    return reasoning_split_for(parser, opens)


def chunker_for(state: GatewayState, gen: InFlightRequest, include_usage: bool) -> StreamChunker:
    """The one chunk builder of a streamed request, for SSE and WebSocket alike."""
    req = gen.request
    chunker = StreamChunker(req.kind, gen.request_id, state.model_name, gen.created,
                            include_usage, echo=gen.prompt_text if req.echo else None,
                            tools=req.tools, tool_parser=state.tool_call_parser(),
                            splitter=lambda: reasoning_split_of(state, gen))
    return chunker


class InterTokenClock:
    """Feeds the inter-token latency histogram from the times deltas reach the client."""

    def __init__(self, state: GatewayState):
        metrics = state.metrics
        self.histogram = metrics.itl.labels(state.model_name) if metrics is not None else None
        self.last = time.monotonic()

    def tick(self, num_tokens: int) -> None:
        now = time.monotonic()
        if num_tokens and self.histogram is not None:
            gap = (now - self.last) / num_tokens
            for _ in range(num_tokens):
                self.histogram.observe(gap)
        self.last = now


def response_headers(gen: InFlightRequest) -> dict:
    return {"x-request-id": gen.request_id, "x-queue-seconds": f"{gen.queue_seconds:.6f}"}


def usage_of(gen: InFlightRequest) -> Usage:
    """The request's usage, with its cost when it was priced (billing's dict is the Cost shape;
    billing imports nothing of the gateway, so it is named here), and for chat its reasoning
    tokens as its answer counted them (gateway/openai/stream_chunker.py)."""
    reasoning = gen.reasoning_tokens if gen.request.kind == "chat" else None
    if gen.charge is None:
        return usage_dict(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens,
                          reasoning_tokens=reasoning)
    cost = cast(Cost, gen.charge.cost.as_dict())
    return usage_dict(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens,
                      {"cost": cost}, reasoning)


class StreamGuard:
    """Watches one SSE answer from beside it: sends a keep-alive comment whenever the stream
    has been quiet for `interval` seconds, and drops the connection when a write has waited
    `send_timeout` seconds on a client that does not read (0: never).

    It runs beside the stream instead of wrapping each delta in a timeout, so the per-token
    path stays a plain queue read. Dropping the connection ends the stream's writes, and the
    request is aborted and billed for what it produced.
    """

    def __init__(self, interval: float, send_timeout: float, keepalive, stream):
        self.interval = interval
        self.send_timeout = send_timeout
        self.keepalive = keepalive  # async () -> bool: False when the client is gone
        self.stream = stream  # () -> SSEStream | None, once the response is open
        self.last = time.monotonic()
        self.owner: asyncio.Task | None = asyncio.current_task()
        self.task: asyncio.Task | None = asyncio.create_task(self._loop())

    def touch(self) -> None:
        self.last = time.monotonic()

    def _pending_since(self) -> float | None:
        sse = self.stream()
        return sse.pending.since if sse is not None else None

    async def _loop(self) -> None:
        while True:
            since = self._pending_since()
            if since is None:  # also look again within half the send timeout of a new write
                wake = self.last + self.interval
                if self.send_timeout:
                    wake = min(wake, time.monotonic() + self.send_timeout / 2)
            else:  # a write is waiting on the client: the stream is stuck, not quiet
                wake = since + (self.send_timeout or self.interval)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            sse = self.stream()
            if sse is not None and sse.pending.since is not None:
                if sse.pending.stalled(self.send_timeout):
                    return self._stalled()
            elif time.monotonic() - self.last >= self.interval:
                self.touch()
                if not await self._send_keepalive():
                    if self.owner is not None:
                        self.owner.cancel()  # the client left while nothing was streaming
                    return

    async def _send_keepalive(self) -> bool:
        if not self.send_timeout:
            return await self.keepalive()
        try:
            return await asyncio.wait_for(self.keepalive(), self.send_timeout)
        except TimeoutError:
            self._stalled()
            return True

    def _stalled(self) -> None:
        log.warning("a client read nothing for %.0f s; dropping its stream", self.send_timeout)
        sse = self.stream()
        if sse is not None:
            sse.abort()  # the pending write should fail and end the stream loop...
        if self.owner is not None:
            self.owner.cancel()  # ...but the job ends even if it does not

    async def stop(self) -> None:
        """Stop watching, and drop every reference to the stream's handler: the handler's
        frame (in a cancellation's traceback) points back here, and the cycle would keep the
        request record and the aiohttp request alive until a full collection."""
        task, current = self.task, asyncio.current_task()
        self.task = self.owner = None
        self.keepalive = self.stream = _nothing
        if task is None or task is current:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _nothing():
    return None


async def stream_sse(request: web.Request, state: GatewayState, gen: InFlightRequest):
    """The SSE answer. Errors before the first event become a plain HTTP error; after it,
    an error event and [DONE]. The response opens lazily so a rejection keeps its status."""
    req = gen.request
    chunker = chunker_for(state, gen, req.include_usage)
    sse: SSEStream | None = None
    opening = asyncio.Lock()
    itl = InterTokenClock(state)

    async def ensure_open() -> SSEStream:
        nonlocal sse
        async with opening:  # the keep-alive task may race the first delta
            if sse is None:
                sse = await SSEStream.open(request, response_headers(gen))
                state.open_responses.add(sse.response)
        return sse

    async def keepalive() -> bool:
        return await (await ensure_open()).keepalive()

    pinger = StreamGuard(state.config.keepalive_seconds, state.config.send_timeout_seconds,
                         keepalive, lambda: sse)
    try:
        # aclosing: leaving the loop (client gone, handler cancelled) aborts the job before
        # this returns, not whenever the generator happens to be finalized
        async with aclosing(state.service.stream(gen)) as deltas:
            async for delta in deltas:
                pinger.touch()
                out = sse if sse is not None else await ensure_open()
                events = chunker.chunks(delta)
                if events and not await out.send_all(events):
                    return out.response  # client gone: leaving the loop aborts the job
                itl.tick(len(delta.token_ids))
        await wait_committed(gen)  # the bill is durable before the client sees it final
        gen.reasoning_tokens = chunker.reasoning_tokens
        out = await ensure_open()
        await out.send_all(chunker.usage(usage_of(gen)), done=True)  # still guarded
        return out.response
    except APIError as exc:
        if sse is None:
            raise
        await sse.send({"error": exc.body()["error"]})
        await sse.send_done()
        return sse.response
    finally:
        await pinger.stop()
        if sse is not None:
            state.open_responses.discard(sse.response)


async def respond_json(state: GatewayState, gen: InFlightRequest) -> web.Response:
    req = gen.request
    texts: dict[int, list[str]] = {i: [] for i in range(req.n)}
    logprobs: dict[int, list] = {i: [] for i in range(req.n)}
    prompt_logprobs: dict[int, list] = {}
    splits = {i: reasoning_split_of(state, gen) for i in range(req.n)}
    reasoning: dict[int, list[str]] = {i: [] for i in range(req.n)}
    async with aclosing(state.service.stream(gen)) as deltas:  # aborted at once if cancelled
        async for delta in deltas:
            split = splits[delta.index]
            if split is None:
                texts[delta.index].append(delta.text)
            else:  # the stream's splitter and count, delta by delta: the same answer
                thought, said, inside = split_piece(split, delta.text,
                                                    delta.finish_reason is not None)
                gen.reasoning_tokens += len(delta.token_ids) if inside else 0
                reasoning[delta.index].append(thought)
                texts[delta.index].append(said)
            if delta.logprobs:
                logprobs[delta.index].extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[delta.index] = delta.prompt_logprobs
    await wait_committed(gen)  # the bill is durable before the client sees the answer
    wants_logprobs = gen.params.logprobs or gen.params.top_logprobs > 0
    choices = []
    for i in range(req.n):
        text: str | None = "".join(texts[i])
        offset, calls, reason = 0, None, gen.finish_reasons.get(i)
        if req.echo:
            text, offset = gen.prompt_text + text, len(gen.prompt_text)
        reader = reader_for(req.tools, parser=state.tool_call_parser()) \
            if req.kind == "chat" else None
        if reader is not None:  # the stream's reader, fed the whole text: the same answer
            text, calls = collect(reader, text)
            reason = finish_reason(reason, reader)
        thought = "".join(reasoning[i]) or None
        choices.append(ChoiceResult(i, text, cast(FinishReason, reason),
                                    logprobs[i] if wants_logprobs else None, offset,
                                    prompt_logprobs.get(i), calls, thought,
                                    splits[i] is not None))
    build = chat_response if req.kind == "chat" else completion_response
    body = build(gen.request_id, state.model_name, gen.created, choices, usage_of(gen))
    return json_response(body, headers=response_headers(gen))
