"""vLLM's `/tokenize` and `/detokenize` bodies and answers (its shapes, so its clients work).

    POST /tokenize    {"prompt": "text"} or {"messages": [...]}, optional "model",
                      "add_special_tokens", "add_generation_prompt", "return_token_strs"
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [ids], optional "model"} -> {"prompt": "text"}

The text is tokenized exactly as a generation request's would be (the same template, the same
checks), so `count` is the `prompt_tokens` a completion with that body would be billed for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.openai.json_fields import read_bool, read_int_list, read_str
from gateway.openai.requests import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    request: GenerationRequest  # the prompt or messages, validated as for generation
    add_special_tokens: bool  # prompts only: BOS and the like, when the model has them
    add_generation_prompt: bool  # chat only: end with the assistant's turn opening
    return_token_strs: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send exactly one of prompt (a text) or messages (a chat)",
                          "prompt" if has_messages else "messages")
    # only what the prompt is made of (the text, and the tools a chat offers): sampling
    # fields have no meaning here and are not read
    text_only = {k: body[k] for k in ("prompt", "messages", "tools", "tool_choice")
                 if k in body}
    request = parse_completion_request(text_only) if has_prompt else parse_chat_request(text_only)
    if isinstance(request.prompt, tuple):
        raise bad_request("prompt must be a text; token ids are already tokens", "prompt")
    return TokenizeRequest(
        model=read_str(body, "model", None), request=request,
        add_special_tokens=read_bool(body, "add_special_tokens", False),
        add_generation_prompt=read_bool(body, "add_generation_prompt", True),
        return_token_strs=read_bool(body, "return_token_strs", False))


def parse_detokenize(body: Any, max_tokens: int) -> tuple[str | None, tuple[int, ...]]:
    """(model, token ids); at most `max_tokens` ids (the context), each checked later against
    the vocabulary."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("tokens") is None:
        raise bad_request("tokens is required", "tokens")
    tokens = read_int_list(body, "tokens", max_tokens)
    if any(t < 0 for t in tokens):
        raise bad_request("tokens must be non-negative integers", "tokens")
    return read_str(body, "model", None), tokens


def tokenize_response(tokens: list[int], max_model_len: int,
                      token_strs: list[str] | None) -> dict:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": token_strs}


def detokenize_response(text: str) -> dict:
    return {"prompt": text}
