"""vLLM's `/tokenize` and `/detokenize` bodies and answers (its shapes, so its clients work).

    POST /tokenize    {"prompt": "text"} or {"messages": [...]}, optional "model",
                      "add_special_tokens", "add_generation_prompt", "return_token_strs"
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [ids], optional "model"} -> {"prompt": "text"}

The bodies are validated by their declarations (gateway/openai/schema/extensions.py), which
share the chat messages, prompt and tools with generation: the text is tokenized exactly as a
generation request's would be (the same template, the same checks), so `count` is the
`prompt_tokens` a completion with that body would be billed for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.openai.requests import GenerationRequest, generation_request
from gateway.openai.schema import read
from gateway.openai.schema.answers import DetokenizeResponse, TokenizeResponse
from gateway.openai.schema.chat import ChatCompletionRequest, CompletionRequest
from gateway.openai.schema.extensions import DetokenizeRequest
from gateway.openai.schema.extensions import TokenizeRequest as TokenizeBody
from gateway.openai.tools import check_raw_tools


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    request: GenerationRequest  # the prompt or messages, validated as for generation
    add_special_tokens: bool  # prompts only: BOS and the like, when the model has them
    add_generation_prompt: bool  # chat only: end with the assistant's turn opening
    return_token_strs: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    if isinstance(body, dict):  # the tools' total first, before any tool's schema is checked
        check_raw_tools(body.get("tools"))
    req = read(TokenizeBody, body)
    return TokenizeRequest(
        model=req.model, request=_text_request(req),
        add_special_tokens=bool(req.add_special_tokens),
        add_generation_prompt=req.add_generation_prompt is not False,
        return_token_strs=bool(req.return_token_strs))


def _text_request(req: TokenizeBody) -> GenerationRequest:
    """The prompt or chat as a generation request holds it. Its fields are validated already
    (the same declarations), so the generation body is assembled from them, not read again;
    only the checks across tools remain. Sampling fields have no meaning here: none is read."""
    if req.messages is not None:
        return generation_request(ChatCompletionRequest.model_construct(
            messages=req.messages, tools=req.tools, tool_choice=req.tool_choice))
    return generation_request(CompletionRequest.model_construct(prompt=req.prompt))


def parse_detokenize(body: Any, max_tokens: int) -> tuple[str | None, tuple[int, ...]]:
    """(model, token ids); at most `max_tokens` ids (the context), each checked later against
    the vocabulary."""
    req = read(DetokenizeRequest, body, context={"max_tokens": max_tokens})
    return req.model, tuple(req.tokens)


def tokenize_response(tokens: list[int], max_model_len: int,
                      token_strs: list[str] | None) -> TokenizeResponse:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": token_strs}


def detokenize_response(text: str) -> DetokenizeResponse:
    return {"prompt": text}
