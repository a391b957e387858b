"""Per-request sampling parameters, validated once at admission.

The gateway builds one `SamplingParams` per request, once its prompt is tokenized and the output
budget known; before that it checks the other fields with `check_sampling_fields`, which builds
nothing. The object crosses to the worker inside an `AddRequest` (contract/frames.py): orjson
writes its fields natively (the derived attributes start with "_", which orjson skips), and the
frame decoder rebuilds it here, validated.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from contract.errors import InvalidRequestError, PromptTooLongError
from contract.structured_spec import validate_spec

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# torch generators accept seeds in this inclusive range (and orjson encodes exactly it)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of an n-choice request: distinct per choice, reproducible,
    and always inside the generator's range (near the top it wraps round to small seeds)."""
    derived = seed + index
    return derived - (1 << 64) if derived > MAX_SEED else derived


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. `seed` makes a sampled output reproducible whatever else shares
    the batch: each seeded request draws from its own generator, advanced once per token.
    `logprobs` asks for the sampled token's log-probability; `top_logprobs` for N alternatives.
    `prompt_logprobs` (None: off) asks, as vLLM does, for every prompt token's log-probability
    given the tokens before it, its rank and that many alternatives; a request asking for it
    computes its whole prompt (the prefix cache serves it nothing).
    `structured` (None: free text) constrains the output to a grammar, a JSON-able spec checked
    by contract/structured_spec.py; `jump_forward` lets the engine append the tokens such a
    grammar forces without sampling them (False: every token sampled).
    `reasoning_budget` (None: unbounded) caps a reasoning model's think block: once it has
    written that many tokens inside `<think>` ... `</think>` without closing it, the engine
    appends the end marker's tokens itself and generation goes on (runtime/structured/
    reasoning.py); a model that does not think is unaffected.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    speculative: bool = True  # False opts this request out of speculative decoding
    structured: dict | None = None  # a grammar spec (contract/structured_spec.py)
    jump_forward: bool = True  # append a grammar's forced tokens without sampling them
    reasoning_budget: int | None = None  # think tokens before the end marker is forced
    if TYPE_CHECKING:  # for the checker only: each instance sets its own in __post_init__;
        _stop_token_set: ClassVar[frozenset[int]]  # ClassVar so it is not a dataclass field
        _structured_key: ClassVar[str | None]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_max_tokens(self.max_tokens)
        _check_fields(self.__dict__)  # every field, already tuples: nothing copied
        # derived, so not fields: named with "_" so that orjson leaves them out of a frame;
        # the engine tests every generated token against the stop set: a set, not a scan
        object.__setattr__(self, "_stop_token_set", frozenset(self.stop_token_ids))
        object.__setattr__(self, "_structured_key", None if self.structured is None
                           else validate_spec(self.structured))

    @property
    def stop_token_set(self) -> frozenset[int]:
        return self._stop_token_set

    @property
    def structured_key(self) -> str | None:
        """The spec's canonical text: the grammar compile cache's key."""
        return self._structured_key

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


# every field but max_tokens, at its default: what a mapping of some fields is checked against
_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams)
                                   if f.name != "max_tokens" and f.default is not MISSING}


def check_sampling_fields(values: Mapping[str, Any]) -> None:
    """Raise what `SamplingParams(max_tokens=..., **values)` would raise for these fields,
    building nothing: the gateway checks a request's fields before tokenization decides its
    output budget, and builds the one SamplingParams after. An unknown name is a TypeError, as
    the constructor's."""
    unknown = values.keys() - _FIELD_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"not sampling fields: {sorted(unknown)}")
    merged = {**_FIELD_DEFAULTS, **values}
    merged["stop"], merged["stop_token_ids"] = tuple(merged["stop"]), \
        tuple(merged["stop_token_ids"])
    _check_fields(merged)
    if merged["structured"] is not None:
        validate_spec(merged["structured"])


def check_kv_capacity(num_prompt_tokens: int, max_tokens: int, capacity_tokens: int) -> None:
    """Raise PromptTooLongError (naming max_tokens) when a prompt and its whole output budget
    cannot fit a worker's KV cache of `capacity_tokens`: the gateway's admission and the
    worker's own check (runtime/scheduling/validate.py) refuse with the same words."""
    if num_prompt_tokens + max_tokens > capacity_tokens:
        raise PromptTooLongError(
            f"prompt plus max_tokens ({num_prompt_tokens + max_tokens} tokens) exceeds the KV "
            f"cache capacity of {capacity_tokens} tokens", param="max_tokens")


def _bad(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {why}", param=param)


def _check_max_tokens(max_tokens: object) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise _bad("max_tokens", f"must be an integer, got {max_tokens!r}")
    if max_tokens < 1:
        raise _bad("max_tokens", f"must be at least 1, got {max_tokens}")


def _check_fields(f: Mapping[str, Any]) -> None:
    """Every field but max_tokens, from a mapping holding all of them (stops as tuples): an
    instance's own __dict__, so that checking one copies nothing."""
    _check_numbers(f)
    _check_logprobs_and_seed(f)
    _check_stops(f)
    if not isinstance(f["jump_forward"], bool):
        raise _bad("jump_forward", f"must be true or false, got {f['jump_forward']!r:.40}")
    budget = f["reasoning_budget"]
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 0):
        raise _bad("max_reasoning_tokens", f"must be null or an integer >= 0, got "
                                           f"{budget!r:.40}")


def _check_numbers(f: Mapping[str, Any]) -> None:
    if not (f["temperature"] >= 0.0):  # also rejects NaN
        raise _bad("temperature", f"must be >= 0, got {f['temperature']}")
    if not (0.0 < f["top_p"] <= 1.0):
        raise _bad("top_p", f"must be in (0, 1], got {f['top_p']}")
    top_k = f["top_k"]
    if not isinstance(top_k, int) or top_k < -1:
        raise _bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {top_k}")
    if not (0.0 <= f["min_p"] <= 1.0):
        raise _bad("min_p", f"must be in [0, 1], got {f['min_p']}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not (-2.0 <= f[name] <= 2.0):
            raise _bad(name, f"must be in [-2, 2], got {f[name]}")
    if not (0.0 < f["repetition_penalty"] <= 10.0):
        raise _bad("repetition_penalty", f"must be in (0, 10], got {f['repetition_penalty']}")


def _check_logprobs_and_seed(f: Mapping[str, Any]) -> None:
    if not (0 <= f["top_logprobs"] <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs",
                   f"must be in [0, {MAX_TOP_LOGPROBS}], got {f['top_logprobs']}")
    k = f["prompt_logprobs"]
    if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                          or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise _bad("prompt_logprobs", f"must be null or an integer in "
                                      f"[0, {MAX_TOP_LOGPROBS}], got {k!r:.40}")
    seed = f["seed"]
    if seed is not None and (not isinstance(seed, int) or not MIN_SEED <= seed <= MAX_SEED):
        raise _bad("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}], got {seed!r:.40}")


def _check_stops(f: Mapping[str, Any]) -> None:
    stop, ids = f["stop"], f["stop_token_ids"]
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
            raise _bad("stop", f"strings must be non-empty and at most "
                               f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.40}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    for t in ids:
        if not isinstance(t, int) or t < 0:
            raise _bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
