"""Checks on a new request, run before anything in the engine changes."""
from __future__ import annotations

from contract.errors import InvalidRequestError, PromptTooLongError
from contract.sampling_params import SamplingParams, check_kv_capacity

MAX_CACHE_SALT_BYTES = 1024


def validate_request(request_id: object, prompt_token_ids: object, params: object,
                     priority: object, cache_salt: object, *, vocab_size: int,
                     max_model_len: int, kv_capacity_tokens: int) -> None:
    """Raise a typed error naming the first problem; return None when the request is valid."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams", param="params")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}",
                                  param="priority")
    _check_salt(cache_salt)
    _check_tokens(prompt_token_ids, vocab_size)
    n = len(prompt_token_ids)  # type: ignore[arg-type]  # a list or tuple: _check_tokens passed
    if n >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {n} tokens; the model's context is {max_model_len} tokens and at least "
            f"one must be left for output", param="prompt")
    if n + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens; ask for at most {max_model_len - n}",
            param="max_tokens")
    # gateways refuse these at admission from the Ready frames' capacities; this stays the
    # backstop: a pool whose largest capacity is another worker's, a request admitted before
    # any worker was ready, a gateway that does not check
    check_kv_capacity(n, params.max_tokens, kv_capacity_tokens)
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise InvalidRequestError(f"stop_token_ids holds {t}, outside the vocabulary "
                                      f"of {vocab_size}", param="stop_token_ids")


def _check_salt(cache_salt: object) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise InvalidRequestError(f"cache_salt must be a string, got {type(cache_salt).__name__}",
                                  param="cache_salt")
    if len(cache_salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes",
                                  param="cache_salt")


def _check_tokens(ids: object, vocab_size: int) -> None:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequestError("prompt is empty: give at least one token", param="prompt")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequestError(f"prompt token {i} is {t!r}, not an integer",
                                      param="prompt")
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"prompt token {i} is {t}, outside the vocabulary "
                                      f"[0, {vocab_size})", param="prompt")
