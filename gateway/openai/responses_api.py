"""The OpenAI Responses API (POST /v1/responses): its body read into a chat conversation, and
its response object and stream events, as plain dicts.

The body is validated by its declaration (gateway/openai/schema/extensions.py), then becomes a
chat body that `parse_chat_request` validates, so sampling checks and defaults are exactly the
chat endpoint's; this module adds only the Responses shape around them. What we cannot honour
(tools, structured output, reasoning, background runs, images and files, include items) is
refused first with a 400 naming the param, never silently ignored.

A reasoning model's think block (gateway/openai/reasoning.py) becomes a `reasoning` output item
before the message, its text one `reasoning_text` content part; streamed, its events are
`response.reasoning_text.delta` / `.done` inside the item's and part's added/done events (the
openai package's types), and the message's events follow once the answer starts.
`reasoning.effort` maps to the chat request's reasoning_effort, and `max_reasoning_tokens`
passes as it does in chat; a model without a reasoning parser refuses an effort other than
"none" (the route checks it, knowing the model).
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
                  "stop_token_ids", "ignore_eos", "priority", "max_reasoning_tokens")
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
    reasoning_effort: Any = None  # reasoning.effort, for the chat parser to check


    def chat_body(self, history: tuple[dict, ...]) -> dict:
        """The chat body of this turn: instructions first, then the stored conversation of
        previous_response_id, then this turn's input."""
        system = () if self.instructions is None else (
            {"role": "system", "content": self.instructions},)
        effort = {} if self.reasoning_effort is None else {
            "reasoning_effort": self.reasoning_effort}
        return {**self.passed, **effort, "messages": [*system, *history, *self.messages],
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
        if param == "reasoning_effort":
            return "reasoning.effort"
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
        passed={k: body[k] for k in PASSED_TO_CHAT if body.get(k) is not None},
        reasoning_effort=_nested(body, "reasoning.effort"))


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
    reasoning_id: str = ""

    def build(self, status: str, text: str | None = None, usage: ResponseUsage | None = None,
              error: dict | None = None, reasoning: str | None = None) -> dict:
        """`reasoning`: a reasoning model's thought, an item before the message."""
        thought = [reasoning_item(self.reasoning_id, reasoning,
                                  "completed" if status == "completed" else "incomplete")
                   ] if reasoning else []
        if status in ("completed", "incomplete"):
            output = [*thought, message_item(self.message_id, text or "", status)]
        else:  # in progress: nothing yet; failed: what was produced before the failure
            output = thought + ([message_item(self.message_id, text, "incomplete")]
                                if text else [])
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
              "reasoning": {"effort": req.reasoning_effort, "summary": None},
              "service_tier": "default",
              "store": stored, "temperature": gen.sampling["temperature"],
              "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice,
              "tools": [], "top_logprobs": 0, "top_p": gen.sampling["top_p"],
              "truncation": "disabled", "user": gen.user}
    return ResponseShell(response_id, "msg_" + uuid.uuid4().hex, fields,
                         "rs_" + uuid.uuid4().hex)


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(message_id: str, text: str | None, status: str) -> dict:
    """The assistant's output message; `text` None: just opened, no content part yet."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning model's thought as a Responses output item; `text` None: just opened."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [reasoning_text(text)]}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def responses_usage(chat_usage: Usage) -> ResponseUsage:
    """Chat usage (with our cost split) under the Responses API's names. The prefix cache
    fills itself as a side effect of serving, so no token is a billed cache write."""
    usage: ResponseUsage = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": chat_usage.get(
            "completion_tokens_details", {"reasoning_tokens": 0})["reasoning_tokens"]},
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
    each must be made just before it is sent). Each method returns the events of one write.

    Without reasoning (`lazy` False) the message's item and part open with the response, as
    always. With a reasoning parser each item opens when its first text comes: the thought's
    reasoning item first (output 0), closed when the answer starts, then the message."""

    def __init__(self, shell: ResponseShell, lazy: bool = False):
        self.shell = shell
        self.sequence_number = 0
        self.lazy = lazy
        self.at = {"item_id": shell.message_id, "output_index": 0, "content_index": 0}
        self.thought: list[str] | None = None  # the reasoning item's text while it is open
        self.num_items = 0  # output items opened so far
        self.message_open = False

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event

    def opening(self) -> list[dict]:
        response = self.shell.build("in_progress")
        events = [self._event("response.created", response=response),
                  self._event("response.in_progress", response=response)]
        return events if self.lazy else events + self._open_message()

    def _open_message(self) -> list[dict]:
        if self.message_open:
            return []
        self.message_open = True
        self.at = {**self.at, "output_index": self.num_items}
        self.num_items += 1
        item = message_item(self.shell.message_id, None, "in_progress")
        return [self._event("response.output_item.added", output_index=self.at["output_index"],
                            item=item),
                self._event("response.content_part.added", **self.at, part=output_text(""))]

    def reasoning(self, text: str) -> list[dict]:
        """New reasoning text (the thought's item opened first)."""
        events = []
        if self.thought is None:
            self.thought = []
            self.num_items += 1
            events += [
                self._event("response.output_item.added", output_index=0,
                            item=reasoning_item(self.shell.reasoning_id, None, "in_progress")),
                self._event("response.content_part.added", **self._thought_at(),
                            part=reasoning_text(""))]
        self.thought.append(text)
        return events + [self._event("response.reasoning_text.delta", **self._thought_at(),
                                     delta=text)]

    def _thought_at(self) -> dict:
        return {"item_id": self.shell.reasoning_id, "output_index": 0, "content_index": 0}

    def _close_thought(self, status: str = "completed") -> list[dict]:
        if not self.thought:
            return []
        text, self.thought = "".join(self.thought), []
        item = reasoning_item(self.shell.reasoning_id, text, status)
        return [self._event("response.reasoning_text.done", **self._thought_at(), text=text),
                self._event("response.content_part.done", **self._thought_at(),
                            part=reasoning_text(text)),
                self._event("response.output_item.done", output_index=0, item=item)]

    def delta(self, text: str) -> list[dict]:
        return [*self._close_thought(), *self._open_message(),
                self._event("response.output_text.delta", **self.at, delta=text, logprobs=[])]

    def closing(self, text: str, status: str) -> list[dict]:
        """The text's, part's and item's done events, once the text is whole."""
        events = [*self._close_thought(
            "completed" if status == "completed" else "incomplete"), *self._open_message()]
        item = message_item(self.shell.message_id, text, status)
        return events + [
            self._event("response.output_text.done", **self.at, text=text, logprobs=[]),
            self._event("response.content_part.done", **self.at, part=output_text(text)),
            self._event("response.output_item.done", output_index=self.at["output_index"],
                        item=item)]

    def final(self, response: dict) -> list[dict]:
        return [self._event(f"response.{response['status']}", response=response)]

    def failed(self, exc: APIError, text: str, reasoning: str | None = None) -> list[dict]:
        """An error after the stream opened: the error, then the failed response."""
        response = self.shell.build("failed", text, error=failure(exc), reasoning=reasoning)
        return [self._event("error", code=exc.code or failure(exc)["code"],
                            message=exc.message, param=exc.param),
                self._event("response.failed", response=response)]
