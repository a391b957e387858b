"""Per-request sampling parameters, validated once at admission."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from contract.errors import InvalidRequestError
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
    if TYPE_CHECKING:  # for the checker only: each instance sets its own in __post_init__;
        stop_token_set: ClassVar[frozenset[int]]  # ClassVar so it is not a dataclass field
        structured_key: ClassVar[str | None]  # the spec's canonical text: the compile cache key

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()
        # the engine tests every generated token against these: a set, not a scan
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))
        object.__setattr__(self, "structured_key", None if self.structured is None
                           else validate_spec(self.structured))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise bad("repetition_penalty",
                      f"must be in (0, 10], got {self.repetition_penalty}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("top_logprobs",
                      f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be null or an integer in "
                                         f"[0, {MAX_TOP_LOGPROBS}], got {k!r:.40}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}], "
                              f"got {self.seed!r:.40}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad("stop", f"strings must be non-empty and at most "
                                  f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.40}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids, "
                                        f"got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if not isinstance(self.jump_forward, bool):
            raise bad("jump_forward", f"must be true or false, got {self.jump_forward!r:.40}")
