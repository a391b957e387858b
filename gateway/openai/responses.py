"""OpenAI response shapes: whole responses, stream chunks, usage and logprobs, as plain dicts.

The caller serialises with orjson. Every builder returns every key OpenAI's own server returns
(null where unknown), so strict clients (the openai SDK, load testers) parse them unchanged.
Each is typed by its TypedDict in gateway/openai/schema/answers.py (the shapes /openapi.json
describes): mypy checks the builders against them, and at run time they are the same dicts.

Logprobs arrive already decoded to text (`LogprobToken`): the gateway owns the tokenizer and
decodes token ids once, so these builders stay pure and need no model.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.openai.schema.answers import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessage,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    ToolCall,
    Usage,
    UsageExtra,
)

# JSON has no -inf; OpenAI reports an impossible token with this floor instead
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class LogprobToken:
    """One generated token's log-probability and its most likely alternatives, as text.

    `raw` is the token's exact bytes when `text` is not (a token holding part of a multi-byte
    character decodes to U+FFFD); None means `text.encode()` is exact.
    """

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    raw: bytes | None = None


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-streamed response.

    `text_offset` is where the first logprob token starts inside `text` (completions only):
    0 normally, the prompt's length when the prompt was echoed in front. A chat choice that
    called tools has `tool_calls` (OpenAI's message.tool_calls) and `text` None when it wrote
    nothing else.
    """

    index: int
    text: str | None
    finish_reason: FinishReason
    logprobs: Sequence[LogprobToken] | None = None
    text_offset: int = 0
    prompt_logprobs: list | None = None  # vLLM's shape (prompt_logprobs_entries), when asked
    tool_calls: list[ToolCall] | None = None
    # chat under a reasoning parser: the think block's text (None: it wrote none); without
    # a parser, `has_reasoning` False and the message has no reasoning keys at all
    reasoning: str | None = None
    has_reasoning: bool = False


def prompt_logprobs_entries(entries: Sequence, token_text) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each token a dict
    keyed by token id (a string in JSON) of {logprob, rank, decoded_token}: the prompt's own
    token with its rank (1 + how many tokens were likelier), then the top alternatives, ranked
    1, 2, ... (the prompt's token appears once, under its own rank, when it is among them).

    `entries` come from the worker: [token, logprob, rank, [[id, logprob], ...]] or None."""
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token, logprob, rank, top = entry
        scored = {str(token): _scored(logprob, rank, token_text(token))}
        for position, (other, other_logprob) in enumerate(top, start=1):
            scored.setdefault(str(other), _scored(other_logprob, position, token_text(other)))
        out.append(scored)
    return out


def _scored(logprob: float, rank: int, text: str) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage_dict(prompt_tokens: int, cached_tokens: int, completion_tokens: int,
               extra: UsageExtra | None = None, reasoning_tokens: int | None = None) -> Usage:
    """OpenAI's usage object, with DeepSeek's prompt_cache_hit_tokens and
    prompt_cache_miss_tokens beside it (the split the bill charges: cached tokens at the
    cache-hit price, the rest at the miss price) and, given `reasoning_tokens` (chat),
    completion_tokens_details; `extra` keys (the cost) are merged in at the top level."""
    usage: Usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": cached_tokens},
                    "prompt_cache_hit_tokens": cached_tokens,
                    "prompt_cache_miss_tokens": prompt_tokens - cached_tokens}
    if reasoning_tokens is not None:  # never more than the output billed
        usage["completion_tokens_details"] = {
            "reasoning_tokens": min(reasoning_tokens, completion_tokens)}
    if extra:
        usage.update(extra)
    return usage


# logprobs

def _finite(logprob: float | None) -> float:
    """-inf (sent by the worker as null: JSON has no infinity) becomes OpenAI's floor."""
    return logprob if logprob is not None and math.isfinite(logprob) else MIN_LOGPROB


def _bytes(text: str, raw: bytes | None = None) -> list[int]:
    return list(raw if raw is not None else text.encode("utf-8", "surrogatepass"))


def chat_logprobs(tokens: Sequence[LogprobToken]) -> ChatLogprobs:
    """Chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    return {"content": [
        {"token": t.text, "logprob": _finite(t.logprob), "bytes": _bytes(t.text, t.raw),
         "top_logprobs": [{"token": text, "logprob": _finite(lp), "bytes": _bytes(text)}
                          for text, lp in t.top]}
        for t in tokens]}


def completion_logprobs(tokens: Sequence[LogprobToken],
                        text_offset: int = 0) -> CompletionLogprobs:
    """Legacy completions shape: parallel lists, alternatives as {text: logprob} dicts.

    `text_offset` is the character offset of the first token in the choice's text.
    """
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [_finite(t.logprob) for t in tokens],
            # two ids may decode to the same text; the first listed is the likelier, keep it
            "top_logprobs": [_top_dict(t.top) for t in tokens],
            "text_offset": offsets}


def _top_dict(top: Sequence[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for text, lp in top:
        out.setdefault(text, _finite(lp))
    return out


# stream chunks

def chat_chunk(id: str, model: str, created: int, index: int, delta: ChunkDelta,
               finish_reason: FinishReason, logprobs: ChatLogprobs | None = None,
               usage: Usage | None = None) -> ChatCompletionChunk:
    chunk: ChatCompletionChunk = {
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_chunk(id: str, model: str, created: int, index: int, text: str,
                     finish_reason: FinishReason, logprobs: CompletionLogprobs | None = None,
                     usage: Usage | None = None) -> Completion:
    chunk: Completion = {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_usage_chunk(id: str, model: str, created: int, usage: Usage) -> ChatCompletionChunk:
    """The last chunk when stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage}


def completion_usage_chunk(id: str, model: str, created: int, usage: Usage) -> Completion:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [], "usage": usage}


# whole responses

def chat_response(id: str, model: str, created: int, choices: Sequence[ChoiceResult],
                  usage: Usage) -> ChatCompletion:
    body: ChatCompletion = {"id": id, "object": "chat.completion", "created": created,
                            "model": model, "choices": [_chat_choice(c) for c in choices],
                            "usage": usage}
    if choices and choices[0].prompt_logprobs is not None:  # vLLM: once, beside the choices
        body["prompt_logprobs"] = choices[0].prompt_logprobs
    return body


def _chat_choice(c: ChoiceResult) -> ChatChoice:
    return {"index": c.index, "message": _chat_message(c),
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            "finish_reason": c.finish_reason}


def _chat_message(c: ChoiceResult) -> ChatMessage:
    message: ChatMessage = {"role": "assistant", "content": c.text}
    if c.has_reasoning:
        message["reasoning_content"] = message["reasoning"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return message


def completion_response(id: str, model: str, created: int, choices: Sequence[ChoiceResult],
                        usage: Usage) -> Completion:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(c) for c in choices], "usage": usage}


def _completion_choice(c: ChoiceResult) -> CompletionChoice:
    choice: CompletionChoice = {
        "index": c.index, "text": c.text,
        "logprobs": None if c.logprobs is None
        else completion_logprobs(c.logprobs, c.text_offset),
        "finish_reason": c.finish_reason}
    if c.prompt_logprobs is not None:  # vLLM's extension, only when asked for
        choice["prompt_logprobs"] = c.prompt_logprobs
    return choice


__all__ = ["MIN_LOGPROB", "LogprobToken", "ChoiceResult", "new_id", "usage_dict",
           "prompt_logprobs_entries",
           "chat_logprobs", "completion_logprobs", "chat_chunk", "completion_chunk",
           "chat_usage_chunk", "completion_usage_chunk", "chat_response", "completion_response"]
