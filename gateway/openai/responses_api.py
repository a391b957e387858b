"""The OpenAI Responses API (POST /v1/responses): its body read into a chat conversation, and
its response object and stream events, as plain dicts.

The body is validated by its declaration (gateway/openai/schema/extensions.py), then becomes a
chat body that `parse_chat_request` validates, so sampling checks and defaults are exactly the
chat endpoint's; this module adds only the Responses shape around them. What we cannot honour
(tools, structured output, reasoning, background runs, images and files, include items) is
refused first with a 400 naming the param, never silently ignored.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, bad_request
from gateway.openai.requests import GenerationRequest
from gateway.openai.schema import read
from gateway.openai.schema.answers import ResponseUsage, Usage
from gateway.openai.schema.chat import joined
from gateway.openai.schema.extensions import ResponsesRequest as ResponsesBody

# handed to the chat parser unchanged, which validates them: the Responses fields it shares,
# then our chat extensions (so a Responses client can use stop, seed, priority, ...)
PASSED_TO_CHAT = ("model", "user", "temperature", "top_p", "stop", "seed", "top_k", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "stop_token_ids", "ignore_eos", "priority")
REFUSED = {  # truthy values of these change what must be produced: refused, never ignored
    "tools": "tools are not supported by this server",
    "prompt": "reusable prompts are not supported by this server; send input",
    "conversation": "conversations are not supported by this server; chain responses with "
                    "previous_response_id",
    "background": "background responses are not supported by this server; use stream",
    "include": "this server fills no include items",  # refused whole: no cap is needed
    "top_logprobs": "top_logprobs is not supported by this server",
}
ONLY = {  # param -> the values we can honour (None: absent), with the reason for the rest
    "truncation": ((None, "disabled"), "a conversation that does not fit is refused, not cut"),
    "tool_choice": ((None, "auto", "none"), "no tools are available"),
    "text.format": ((None, {"type": "text"}), 'only {"type": "text"} is supported'),
    "text.verbosity": ((None, "medium"), "it is not supported by this server"),
    "reasoning.effort": ((None, "none"), "this model does not reason"),
    "reasoning.summary": ((None,), "this model does not reason"),
    "reasoning.generate_summary": ((None,), "this model does not reason"),
}
# a failure's `error.code` must be one of OpenAI's; ours map onto the nearest
FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


@dataclass(frozen=True)
class ResponsesRequest:
    """One validated Responses body: this turn's messages and what the response echoes."""

    messages: tuple[dict, ...]  # this turn's input as chat messages
    sources: tuple[str, ...]  # the param each message came from: "input" or "input[i]"
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    store: bool
    stream: bool
    metadata: dict
    parallel_tool_calls: bool
    tool_choice: str
    passed: dict  # fields for the chat parser (PASSED_TO_CHAT)

    def chat_body(self, history: tuple[dict, ...]) -> dict:
        """The chat body of this turn: instructions first, then the stored conversation of
        previous_response_id, then this turn's input."""
        system = () if self.instructions is None else (
            {"role": "system", "content": self.instructions},)
        return {**self.passed, "messages": [*system, *history, *self.messages],
                "max_tokens": self.max_output_tokens, "stream": self.stream}

    def renamed(self, exc: APIError, num_history: int) -> APIError:
        """A chat-side error under the Responses param it came from (messages[2] -> input[1],
        max_tokens -> max_output_tokens), so the client sees names it sent."""
        if exc.param is None:
            return exc
        param = self._param_of(exc.param, num_history)
        if param == exc.param:
            return exc
        return APIError(exc.status, exc.message.replace(exc.param, param), exc.type, param,
                        exc.code, exc.headers)

    def _param_of(self, param: str, num_history: int) -> str:
        if param == "max_tokens":
            return "max_output_tokens"
        if param == "messages":
            return "input"
        match = re.fullmatch(r"messages\[(\d+)\](.*)", param)
        if match is None:
            return param
        i = int(match[1]) - (self.instructions is not None)
        if i < 0:
            return "instructions"
        if i < num_history:
            return "previous_response_id"
        source = self.sources[i - num_history]
        return source if source == "input" else source + match[2]


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _refuse_unsupported(body)
    req = read(ResponsesBody, body)
    messages, sources = _input(req.input)
    return ResponsesRequest(
        messages, sources, instructions=req.instructions,
        previous_response_id=req.previous_response_id,
        max_output_tokens=req.max_output_tokens,
        store=req.store is not False, stream=bool(req.stream), metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=req.tool_choice or "auto",
        passed={k: body[k] for k in PASSED_TO_CHAT if body.get(k) is not None})


def _refuse_unsupported(body: dict) -> None:
    """What we cannot honour, refused before anything else is read."""
    for name, why in REFUSED.items():
        if body.get(name):  # absent, null, empty, false, 0: harmless
            raise bad_request(why, name)
    for param, (allowed, why) in ONLY.items():
        value = _nested(body, param)
        if value not in allowed:
            raise bad_request(f"{param} {value!r:.60} cannot be honoured: {why}", param)


def _nested(body: dict, param: str) -> Any:
    """The value at a dotted param ("text.format"); an outer value that is no object is the
    declaration's to refuse."""
    outer, _, inner = param.partition(".")
    if not inner:
        return body.get(outer)
    value = body.get(outer)
    return value.get(inner) if isinstance(value, dict) else None


def _input(value: str | list) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """This turn's chat messages, and the param each came from."""
    if isinstance(value, str):
        return ({"role": "user", "content": value},), ("input",)
    sources = tuple(f"input[{i}]" for i in range(len(value)))
    # separate parts read as separate paragraphs, as the chat endpoint joins them
    return tuple({"role": m.role, "content": joined(m.content)} for m in value), sources


# the response object

def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass(frozen=True)
class ResponseShell:
    """A response before its output: its ids and the request's echo, made once at admission."""

    id: str
    message_id: str
    fields: dict  # every key of the Response object but the ones `build` fills

    def build(self, status: str, text: str | None = None, usage: ResponseUsage | None = None,
              error: dict | None = None) -> dict:
        if status in ("completed", "incomplete"):
            output = [message_item(self.message_id, text or "", status)]
        else:  # in progress: nothing yet; failed: what was produced before the failure
            output = [message_item(self.message_id, text, "incomplete")] if text else []
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.fields, "status": status, "error": error,
                "incomplete_details": incomplete, "output": output, "usage": usage,
                "completed_at": int(time.time()) if status == "completed" else None}


def response_shell(response_id: str, req: ResponsesRequest, gen: GenerationRequest,
                   model: str, stored: bool) -> ResponseShell:
    """The shell of a response to `req`; `gen` gives the sampling actually used."""
    fields = {"id": response_id, "object": "response", "created_at": int(time.time()),
              "model": model, "background": False, "instructions": req.instructions,
              "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
              "metadata": req.metadata, "parallel_tool_calls": req.parallel_tool_calls,
              "previous_response_id": req.previous_response_id,
              "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
              "store": stored, "temperature": gen.sampling["temperature"],
              "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice,
              "tools": [], "top_logprobs": 0, "top_p": gen.sampling["top_p"],
              "truncation": "disabled", "user": gen.user}
    return ResponseShell(response_id, "msg_" + uuid.uuid4().hex, fields)


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(message_id: str, text: str | None, status: str) -> dict:
    """The assistant's output message; `text` None: just opened, no content part yet."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_usage(chat_usage: Usage) -> ResponseUsage:
    """Chat usage (with our cost split) under the Responses API's names. The prefix cache
    fills itself as a side effect of serving, so no token is a billed cache write."""
    usage: ResponseUsage = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"]}
    if "cost" in chat_usage:
        usage["cost"] = chat_usage["cost"]
    return usage


def failure(exc: APIError) -> dict:
    """A failed response's `error` object."""
    return {"code": FAILURE_CODES.get(exc.status, "server_error"), "message": exc.message}


# stream events

class ResponseEvents:
    """The stream events of one response in OpenAI's order, numbered from 0 as made (so
    each must be made just before it is sent). Each method returns the events of one write."""

    def __init__(self, shell: ResponseShell):
        self.shell = shell
        self.sequence_number = 0
        self.at = {"item_id": shell.message_id, "output_index": 0, "content_index": 0}

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event

    def opening(self) -> list[dict]:
        response = self.shell.build("in_progress")
        item = message_item(self.shell.message_id, None, "in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self.at, part=output_text(""))]

    def delta(self, text: str) -> list[dict]:
        return [self._event("response.output_text.delta", **self.at, delta=text, logprobs=[])]

    def closing(self, text: str, status: str) -> list[dict]:
        """The text's, part's and item's done events, once the text is whole."""
        item = message_item(self.shell.message_id, text, status)
        return [self._event("response.output_text.done", **self.at, text=text, logprobs=[]),
                self._event("response.content_part.done", **self.at, part=output_text(text)),
                self._event("response.output_item.done", output_index=0, item=item)]

    def final(self, response: dict) -> list[dict]:
        return [self._event(f"response.{response['status']}", response=response)]

    def failed(self, exc: APIError, text: str) -> list[dict]:
        """An error after the stream opened: the error, then the failed response."""
        response = self.shell.build("failed", text, error=failure(exc))
        return [self._event("error", code=exc.code or failure(exc)["code"],
                            message=exc.message, param=exc.param),
                self._event("response.failed", response=response)]
