"""Compiling specs into llguidance grammars, off the step loop, cached by content.

llguidance parses lazily (an Earley parser over a derivative-based lexer), so "compiling" is
building and checking the grammar and one prototype matcher: 1-15 ms for the schemas of
bench/structured.py on this model's 49,152-token vocabulary, about 0.5 s for a 59 KB one. It
runs in a small thread pool (the Rust code drops the GIL), so no step waits for it. Each
request's matcher is a copy of the prototype (microseconds).

Compiles are cached by the spec's canonical text in a bounded LRU, failures included, so a
repeated bad spec is refused at once. The tokenizer's llguidance view is built when the engine
starts: for 49,152 tokens it takes 0.4-2 s and holds the GIL throughout, so built lazily it
would stall every running request's steps at the first structured one.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance

from contract.tokenizer import Tokenizer
from runtime.structured.bounds import JSON_OVERRIDES, bounded_schema
from runtime.structured.finite import has_finite_instance

if TYPE_CHECKING:  # the stub's TypedDict of JSON options; not importable at run time
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 128  # compiled grammars kept (with their failures), least recently used first out
COMPILE_THREADS = 2
# how generated JSON is laid out: no free whitespace (a small model would otherwise pad with
# newlines forever) and the separators models write, which leaves keys, quotes and braces as
# forced text for jump-forward. A schema's own "x-guidance" may change the separators, never
# the whitespace (runtime/structured/bounds.py).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": "}
# llguidance's bounds on the work of one mask (and of one jump-forward), which run on the step
# loop: Earley items per step (about 20k/ms; the default 50k let one unsatisfiable schema take
# 67 ms a mask here) and lexer fuel (about 14k/ms). A mask past them puts the matcher in error,
# which ends its request (runtime/structured/manager.py). Errors stay short: a verbose one
# repeats the parser state into the client's error message.
LIMITS: dict[str, Any] = dict(verbose_errors=False, step_max_items=10_000,
                              step_lexer_fuel=100_000)
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar and a prototype matcher in its start state (never advanced)."""

    grammar: str
    prototype: llguidance.LLMatcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.prototype.deep_copy()


@dataclass
class CompileJob:
    """One spec's compile: its future result (a CompiledGrammar, or an error message) and
    when the compile itself began (None while queued behind others)."""

    future: Future = field(default_factory=Future)
    started: float | None = None
    seconds: float | None = None  # how long the compile took, once done

    @property
    def done(self) -> bool:
        return self.future.done()

    def running_for(self, now: float) -> float:
        return 0.0 if self.started is None or self.done else now - self.started


def grammar_text(spec: dict) -> str:
    """The llguidance grammar of a (validated) spec."""
    kind = spec["type"]
    if kind == "json":
        schema = spec.get("schema", {"type": "object"})
        if not has_finite_instance(schema):
            raise ValueError("no finite JSON value matches the schema (a required property or "
                             "item refers back to a schema that contains it)")
        return llguidance.LLMatcher.grammar_from_json_schema(
            bounded_schema(schema), defaults=JSON_OPTIONS, overrides=JSON_OVERRIDES)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec["pattern"])
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec["choices"]))
    return llguidance.grammar_from("grammar", spec["grammar"])  # Lark, or GBNF converted


def compile_grammar(tokenizer: llguidance.LLTokenizer, spec: dict) -> CompiledGrammar:
    """Build and check the grammar; raise ValueError with llguidance's reason if it is bad."""
    limits = llguidance.LLParserLimits(**LIMITS)
    grammar = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=limits)
    if is_error:
        raise ValueError(messages[0] if messages else "invalid grammar")
    prototype = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if prototype.is_error():
        raise ValueError(prototype.get_error())
    check_start(prototype)
    return CompiledGrammar(grammar, prototype)


def check_start(prototype: llguidance.LLMatcher) -> None:
    """Raise ValueError if the grammar's first mask or its forced start fails within LIMITS: a
    grammar forcing endless text (`start: "a" start`) is refused here, in the pool, not
    found by a request's first step. A copy is probed: the prototype stays unadvanced."""
    probe = prototype.deep_copy()
    probe.compute_bitmask()
    forced = [] if probe.is_error() else probe.compute_ff_tokens()
    if not probe.is_error() and forced:
        probe.consume_tokens(forced)
    if probe.is_error():
        raise ValueError(f"its output cannot be computed within this server's limits "
                         f"({first_line(probe.get_error())})")


def first_line(error: str) -> str:
    """llguidance's message without its trailer (`<non-verbose/>`)."""
    return error.strip().splitlines()[0] if error.strip() else "error"


def mask_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> int:
    """Tokens a mask covers: the model's logits, or the tokenizer's ids if it has more."""
    return max(vocab_size, tokenizer.vocab_size)


def make_lltokenizer(tokenizer: Tokenizer, vocab_size: int,
                     eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: the byte-level BPE from our tokenizer's JSON,
    padded to the model's vocabulary (its masks then cover every logit), with the model's
    end-of-sequence ids as the tokens a complete grammar allows."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                  n_vocab=mask_vocab_size(tokenizer, vocab_size),
                                  eos_token=list(eos_token_ids))


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = CACHE_SIZE, threads: int = COMPILE_THREADS):
        try:
            self.lltokenizer: llguidance.LLTokenizer | None = make_lltokenizer(
                tokenizer, vocab_size, eos_token_ids)
            self.unavailable = ""
        except Exception as exc:  # noqa: BLE001 - a vocabulary llguidance cannot read
            self.lltokenizer, self.unavailable = None, f"{type(exc).__name__}: {exc}"[:200]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, CompileJob] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, key: str, spec: dict) -> CompileJob:
        """The compile of `spec` (canonical text `key`): cached, or started now."""
        job = self._cache.get(key)
        if job is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return job
        job = CompileJob()
        self._cache[key] = job
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        self.num_compiles += 1
        self._pool.submit(self._run, job, spec)
        return job

    def _run(self, job: CompileJob, spec: dict) -> None:
        job.started = time.monotonic()
        try:
            assert self.lltokenizer is not None  # attach refuses specs without one
            result: CompiledGrammar | str = compile_grammar(self.lltokenizer, spec)
        except Exception as exc:  # noqa: BLE001 - every failure refuses the request
            result = (str(exc) or type(exc).__name__)[:MAX_ERROR_CHARS]
        job.seconds = time.monotonic() - job.started
        job.future.set_result(result)
