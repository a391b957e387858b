"""From a validated API request to a stream of per-choice deltas; no HTTP here.

`prepare` tokenizes, picks the output budget, checks the context and the workers' KV capacity
before anything is queued, and makes the request's in-flight record (gateway/serving/inflight.py)
with its one `SamplingParams`; `enqueue` queues it; `stream` waits for a worker and
yields each choice's new text as it arrives. Leaving the iteration early (the client went
away) cancels the request wherever it is: queue entry or worker request.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import orjson

from contract.errors import PromptTooLongError
from contract.frames import Rejected
from contract.sampling_params import check_kv_capacity
from gateway.errors import APIError, bad_request, rate_limited, server_error
from gateway.openai.requests import GenerationRequest
from gateway.openai.responses import LogprobToken, new_id, prompt_logprobs_entries
from gateway.serving.dispatch import Dispatcher, DispatchFailed
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase
from gateway.serving.queue import QueueFull
from gateway.workers.handle import WorkerDied
from gateway.workers.output_stream import DEFAULT_LIMIT_BYTES, OutputStream


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobToken] | None
    finish_reason: str | None  # set on the choice's last delta
    prompt_logprobs: list | None = None  # on the choice's first delta, when asked for


# texts longer than this are tokenized off the event loop: a thread hop costs about 50 us,
# tokenizing 8 kB about 5 ms
THREAD_TOKENIZE_BYTES = 8192
THREAD_RENDER_MESSAGES = 32  # conversations longer than this are templated in a thread

# A whole (non-streamed) answer is built on the event loop and held in memory at once, so its
# parts that multiply request parameters are capped before any work. A logprob entry is about
# 60-90 bytes of JSON and 1-2 us of loop time to decode and build; 32768 of them (about 2.5 MiB)
# are built in well under the 100 ms that would show as a hitch in every other stream.
MAX_ANSWER_LOGPROBS = 32768  # n x prompt tokens x (prompt_logprobs + 1), plus the outputs'
MAX_ECHO_BYTES = 2 << 20  # n x the echoed prompt's UTF-8 bytes


class GenerationService:
    def __init__(self, tokenizer, dispatcher: Dispatcher, table: InFlightTable,
                 max_model_len: int, vocab_size: int, default_max_tokens: int | None = None,
                 accounting=None, stream_buffer_bytes: int = DEFAULT_LIMIT_BYTES):
        self.table = table
        self.stream_buffer_bytes = stream_buffer_bytes
        self.accounting = accounting
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        # control tokens a client's message text must not smuggle in (role injection)
        self.special_texts = tuple(sorted(
            t.content for t in tokenizer.backend.get_added_tokens_decoder().values()
            if t.special))
        # one pass over each message finds whether any of them is there at all
        self.special_pattern = re.compile("|".join(map(re.escape, self.special_texts))) \
            if self.special_texts else None
        # no token covers more bytes than this, so a longer text cannot fit the context
        self.max_token_bytes = _max_token_bytes(tokenizer)

    # ---- before the queue ---------------------------------------------------------------
    async def prepare(self, request: GenerationRequest, salt: str | None = None,
                      request_id: str | None = None,
                      priority: int | None = None) -> InFlightRequest:
        if isinstance(request.prompt, str) and not request.stream:
            check_echo(request, request.prompt)  # before the tokenizer spends on it
        prompt_text, prompt = await self._tokenize(request)
        budget = self._budget(request, len(prompt))
        if not request.stream:  # a stream sends each part as it comes and keeps none
            budget = check_answer_size(request, len(prompt), prompt_text, budget)
        params = request.sampling_params(budget)  # the one build
        return InFlightRequest(request_id or new_id(request.kind), request, prompt, prompt_text,
                               params, request.priority if priority is None else priority, salt,
                               OutputStream(self.stream_buffer_bytes))

    def _budget(self, request: GenerationRequest, n: int) -> int:
        """The output budget of a prompt of `n` tokens: the client's max_tokens, or the most
        that fits. A 400 when the prompt and it cannot fit the context or any worker's KV."""
        if n == 0:
            raise bad_request("the prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise self._too_long(n, "messages" if request.kind == "chat" else "prompt")
        room = self.max_model_len - n
        capacity = self.dispatcher.kv_capacity_tokens()
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = min(room, self.default_max_tokens or room)
            if capacity and n < capacity:  # a budget no worker can hold is no default
                max_tokens = min(max_tokens, capacity - n)
        elif max_tokens > room:
            raise bad_request(f"max_tokens is {max_tokens}, but the prompt has {n} tokens and "
                              f"the context is {self.max_model_len}: at most {room} fit",
                              param="max_tokens", code="context_length_exceeded")
        if capacity:
            _check_kv_capacity(n, max_tokens, capacity)
        return max_tokens

    async def tokenize(self, request: GenerationRequest, add_generation_prompt: bool = True,
                       add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids exactly as `prepare` makes them (for /tokenize)."""
        _, ids = await self._tokenize(request, add_generation_prompt, add_special_tokens)
        return ids

    def detokenize(self, ids: tuple[int, ...]) -> str:
        self._check_vocabulary(ids, "tokens")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    async def _tokenize(self, request: GenerationRequest, add_generation_prompt: bool = True,
                        add_special_tokens: bool = False) -> tuple[str, list[int]]:
        if request.kind == "chat":
            messages = list(request.messages)
            texts = list(_chat_texts(request))
            self._check_no_special_tokens(texts)
            # refused on its size before the template runs: rendering costs per message
            self._check_fits(sum(_utf8_size(t) for _, t in texts), "messages")
            tools = request.tools.offered if request.tools is not None else None
            text = await self._render(messages, add_generation_prompt, tools,
                                      sum(len(t) for _, t in texts))
            return text, await self._encode(text, "messages")
        if isinstance(request.prompt, str):
            return request.prompt, await self._encode(request.prompt, "prompt",
                                                      add_special_tokens)
        ids = list(request.prompt)
        if len(ids) >= self.max_model_len:  # before any per-token work
            raise self._too_long(len(ids), "prompt")
        self._check_vocabulary(ids, "prompt")
        return self.tokenizer.decode(ids, skip_special_tokens=False), ids

    def _check_vocabulary(self, ids, param: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise bad_request(f"{param}[{i}] is token {t}, outside the vocabulary "
                                  f"[0, {self.vocab_size})", param=param)

    async def _render(self, messages: list[dict], add_generation_prompt: bool,
                      tools: list[dict] | None, chars: int) -> str:
        """The chat template (with the tools it offers), in a thread when the conversation is
        long: Jinja takes about 10 us a message, and the event loop serves every other stream
        meanwhile."""
        render = self.tokenizer.apply_chat_template
        if len(messages) <= THREAD_RENDER_MESSAGES and chars <= THREAD_TOKENIZE_BYTES:
            return render(messages, add_generation_prompt, tools)
        return await asyncio.to_thread(render, messages, add_generation_prompt, tools)

    async def _encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenize, refusing first (cheaply) a text too long to fit whatever its tokens, so
        the cost stays bounded by the context. A long text is tokenized in a thread without
        the GIL (about 0.6 ms per kB on one core): every other stream goes on meanwhile."""
        size = _utf8_size(text)
        self._check_fits(size, param)
        if size <= THREAD_TOKENIZE_BYTES:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode_without_gil, text,
                                       add_special_tokens)

    def _check_fits(self, size: int, param: str) -> None:
        """No token covers more than `max_token_bytes`: a longer text cannot fit the context."""
        if size > self.max_model_len * self.max_token_bytes:
            raise bad_request(f"the prompt is {size} bytes: more than this model's context of "
                              f"{self.max_model_len} tokens can hold", param=param,
                              code="context_length_exceeded")

    def _too_long(self, n: int, param: str):
        return bad_request(f"the prompt has {n} tokens; this model's context is "
                           f"{self.max_model_len} tokens", param=param,
                           code="context_length_exceeded")

    def _check_no_special_tokens(self, texts: list[tuple[str, str]]) -> None:
        """`texts` are (param, text): every text the template will place, tools included."""
        if self.special_pattern is None:
            return
        for param, text in texts:
            if self.special_pattern.search(text) is None:
                continue
            for special in self.special_texts:  # name the first in sorted order, as always
                if special in text:
                    raise bad_request(f"{param} contains the control token {special!r}, "
                                      "which only the chat template may place", param=param,
                                      code="control_token_in_content")

    # ---- queue, worker, stream ----------------------------------------------------------
    def enqueue(self, gen: InFlightRequest) -> None:
        gen.enqueued_at = time.monotonic()
        self.table.move(gen, Phase.QUEUED)
        start = gen.charge.virtual_start if gen.charge is not None else None
        try:
            self.dispatcher.enqueue(gen, virtual_start=start)
        except QueueFull as exc:
            self._drop(gen, "rejected")
            raise rate_limited("the request queue is full; retry later",
                               retry_after_s=exc.retry_after) from None

    def _drop(self, gen: InFlightRequest, status: str) -> None:
        if self.accounting is not None:
            self.accounting.drop(gen, status)

    async def stream(self, gen: InFlightRequest) -> AsyncGenerator[ChoiceDelta, None]:
        """Yield deltas until every choice has finished. Must follow `enqueue`. Callers
        iterate it under `contextlib.aclosing`, so leaving early aborts the request at once
        rather than when the generator is finalized."""
        done = False
        try:
            try:
                await gen.assigned
            except (WorkerDied, DispatchFailed) as exc:
                self._drop(gen, "error")
                raise server_error(f"no worker could take the request: {exc}") from None
            except QueueFull as exc:  # a more urgent request took its place in the queue
                self._drop(gen, "rejected")
                raise rate_limited("the request queue is full; a more urgent request took "
                                   "this one's place", retry_after_s=exc.retry_after) from None
            index = {sub_id: i for i, sub_id in enumerate(gen.sub_ids)}
            remaining = set(index)
            while remaining:
                item = await gen.stream.get()
                delta = self._delta(gen, index, item)
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    remaining.discard(gen.sub_ids[delta.index])
                yield delta
            done = True
        finally:
            if not done and self.dispatcher.cancel(gen):
                self._drop(gen, "cancelled")  # it left the queue before any worker saw it

    def _delta(self, gen: InFlightRequest, index: dict, item) -> ChoiceDelta | None:
        if isinstance(item, WorkerDied):
            raise server_error(f"the worker serving this request failed: {item}")
        if isinstance(item, Rejected):
            raise bad_request(item.error["message"], param=item.error.get("param"))
        i = index.get(item["id"])
        if i is None:
            return None
        if item["finished"] and item["reason"] == "abort" and gen.stream.overflowed:
            raise APIError(408, f"the client left more than {self.stream_buffer_bytes} bytes "
                           "of output unread; the request was stopped and is billed for what "
                           "it produced", code="slow_reader")
        prompt = item.get("prompt_logprobs")
        return ChoiceDelta(i, item["text"], item["tokens"], self._logprobs(item),
                           item["reason"] if item["finished"] else None,
                           None if prompt is None
                           else prompt_logprobs_entries(prompt, self.token_text))

    def _logprobs(self, item: dict) -> list[LogprobToken] | None:
        if item.get("logprobs") is None:
            return None
        out = []
        for token_id, logprob, top in item["logprobs"]:
            alternatives = tuple((self.token_text(t), lp) for t, lp in top)
            out.append(LogprobToken(self.token_text(token_id), logprob, alternatives,
                                    self.tokenizer.token_bytes(token_id)))
        return out

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_texts(request: GenerationRequest):
    """(param, text) for every client text a chat prompt is rendered from: message contents,
    earlier calls and results, and the tools' names, descriptions and parameters."""
    for i, m in enumerate(request.messages or ()):
        yield f"messages[{i}].content", m["content"]
        for j, call in enumerate(m.get("tool_calls", ())):
            where = f"messages[{i}].tool_calls[{j}]"
            yield f"{where}.id", call["id"]
            yield f"{where}.function.name", call["function"]["name"]
            yield f"{where}.function.arguments", call["function"]["arguments"]
        if "tool_call_id" in m:
            yield f"messages[{i}].tool_call_id", m["tool_call_id"]
    for k, function in enumerate(request.tools.functions if request.tools else ()):
        yield f"tools[{k}].function", orjson.dumps(function.as_tool()).decode()


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _max_token_bytes(tokenizer) -> int:
    longest = 1
    for i in range(tokenizer.backend.get_vocab_size()):
        try:
            longest = max(longest, len(tokenizer.token_bytes(i)))
        except Exception:  # noqa: BLE001 - a hole in the vocabulary covers nothing
            pass
    return longest


def check_echo(request: GenerationRequest, prompt_text: str) -> None:
    """A 400 naming echo when n copies of the prompt are over MAX_ECHO_BYTES."""
    if not request.echo:
        return
    echoed = request.n * _utf8_size(prompt_text)
    if echoed > MAX_ECHO_BYTES:
        raise bad_request(f"echo with n={request.n} would answer {echoed} bytes of prompt; "
                          f"at most {MAX_ECHO_BYTES} are allowed: lower n or stream",
                          param="echo")


def check_answer_size(request: GenerationRequest, num_prompt: int, prompt_text: str,
                      budget: int) -> int:
    """The output budget a non-streamed answer may have, or a 400 naming the param whose
    product with the others puts its worst case over a cap. Each choice's worker scores the
    prompt (and sends it) on its own, so prompt logprobs count n times for chat too."""
    n, sampling = request.n, request.sampling
    check_echo(request, prompt_text)
    k = sampling.get("prompt_logprobs")
    scored = 0 if k is None else n * num_prompt * (k + 1)
    if scored > MAX_ANSWER_LOGPROBS:
        raise bad_request(f"prompt_logprobs={k} over {num_prompt} prompt tokens with n={n} is "
                          f"{scored} logprob entries; at most {MAX_ANSWER_LOGPROBS} are "
                          "allowed: lower prompt_logprobs or n, or shorten the prompt",
                          param="prompt_logprobs")
    if not sampling.get("logprobs") and not sampling.get("top_logprobs"):
        return budget
    per_token = n * (sampling.get("top_logprobs", 0) + 1)
    room = (MAX_ANSWER_LOGPROBS - scored) // per_token
    if request.max_tokens is None and room >= 1:  # a default no answer can hold is no default
        return min(budget, room)
    if budget > room:
        chat_top = request.kind == "chat" and sampling.get("top_logprobs")
        param = "top_logprobs" if chat_top else "logprobs"
        raise bad_request(f"{param} with n={n} and max_tokens={budget} could be "
                          f"{budget * per_token} logprob entries; at most "
                          f"{MAX_ANSWER_LOGPROBS} are allowed: lower max_tokens, n or "
                          f"{param}, or stream", param=param)
    return budget


def _check_kv_capacity(n: int, max_tokens: int, capacity: int) -> None:
    """Refused as a worker refuses it (its Rejected frame becomes this same 400, see `_delta`),
    only earlier: before the request is billed, queued or sent."""
    try:
        check_kv_capacity(n, max_tokens, capacity)
    except PromptTooLongError as exc:
        raise bad_request(str(exc), param=exc.param) from None
