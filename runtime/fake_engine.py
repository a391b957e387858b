"""A deterministic stand-in for LLMEngine with the same worker-facing surface (`EngineCore`,
runtime/engine_core.py) and no model.

Gateway tests and benchmarks use it where the model's speed would only add noise. It uses the
real SmolLM2 tokenizer (read from the GGUF metadata, no weights), emits a fixed cycle of word
tokens, one per running request per step, after `step_seconds` of simulated work, honours
max_tokens, stop strings, stop token ids, priorities and max_num_seqs, and reports cached
tokens as the block-aligned longest prefix its simulated prefix cache holds under the same salt
(none for a request asking for prompt logprobs, which reads no cache, as in the model engine).

The simulated cache is a bounded LRU of `num_blocks` blocks keyed by the model engine's own
chained hashes (runtime/kv/prefix_cache.py, rooted in `model_id` and the salt), so it publishes
the same KV events (runtime/kv/events.py) a model worker would for the same prompts: a
prompt's blocks are cached when it arrives, and its output's full blocks when it ends (all but
the last token, whose KV a model never computes); each use moves a request's blocks to the
recent end, its first block last, so a prefix outlives its suffixes, as in the block pool.
A step's simulated work is `step_seconds` plus `prefill_seconds_per_token` for each prompt token
the cache did not serve among the requests getting their first token; `sleep` spends it (a
simulation passes its own clock).

Structured outputs: a `choice` spec makes it emit the first choice's tokens and then the
end-of-sequence token (finish "stop", as the model engine ends a complete grammar); other
specs (json, regex, grammar) are accepted and ignored: the word cycle matches none of them.
`jump_forward` changes nothing here.

Reasoning: a prompt that ends inside an open think block (a reasoning model's template,
given with --chat-template) is answered with a short scripted thought, its end marker written
in several tokens (SmolLM2's vocabulary has no `</think>` token), then the word cycle; with a
`reasoning_budget` the thought is cut after that many tokens and the marker follows at once,
as the model engine forces it (runtime/structured/reasoning.py); a choice spec's tokens come
after the thought, as the model engine's grammar waits for it.

Its fake distribution always makes the token it names the most likely at logprob -0.1, the
n-th alternative at -0.1 * n: so for sampled tokens and for prompt tokens alike (rank 1).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from contract.block_hashing import block_hashes, root_hash
from contract.errors import DuplicateRequestError
from contract.frames import KvEvents
from contract.model_files import FAKE_MODEL_NAME
from contract.outputs import (
    PromptLogprob,
    RequestOutput,
    StepStats,
    TokenLogprob,
    Usage,
    wall_clock,
)
from contract.sampling_params import SamplingParams
from runtime.detokenizer import IncrementalDetokenizer
from runtime.kv.events import KvEventLog, event_limit
from runtime.scheduling.validate import validate_request

WORDS = " The quick brown fox jumps over the lazy dog and keeps running through the field."
THOUGHT = "Let me think about the fox."  # what it thinks in an open think block
THOUGHT_END = "\n</think>\n\n"


@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    cached: int
    detok: IncrementalDetokenizer
    salt: str | None = None
    hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    output: list[int] = field(default_factory=list)
    first_token: float | None = None
    script: list[int] | None = None  # the tokens a choice spec makes it emit, then stop
    thought: list[int] = field(default_factory=list)  # emitted before the word cycle


class BlockLru:
    """The fake's prefix cache: chained block hashes, least recently used first, bounded."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.events = KvEventLog(lambda: list(self._blocks), event_limit(capacity))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_leading(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are cached (a chain breaks at its first miss)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._blocks:
            n += 1
        return n

    def use(self, hashes: list[bytes]) -> None:
        """Cache (or refresh) a request's blocks, the first one most recent; evict past the
        capacity."""
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                self.events.stored(h)
        while len(self._blocks) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            self.events.removed(h)
            self.evictions += 1


class FakeEngine:
    def __init__(self, tokenizer=None, *, step_seconds: float = 0.002, max_num_seqs: int = 64,
                 max_model_len: int = 8192, block_size: int = 16, num_blocks: int = 4096,
                 model_id: str = FAKE_MODEL_NAME, prefill_seconds_per_token: float = 0.0,
                 sleep: Callable[[float], None] = time.sleep):
        if tokenizer is None:
            from runtime.loading.gguf import read_gguf_tokenizer
            from runtime.loading.loader import default_model_path
            tokenizer = read_gguf_tokenizer(default_model_path())
        self.tokenizer = tokenizer
        self.step_seconds = step_seconds
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.words = tokenizer.encode(WORDS)
        self.model_id = model_id  # the prefix-cache root, as LLMEngine.model_id
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.sleep = sleep
        self.requests: dict[str, _FakeRequest] = {}
        self.cache = BlockLru(num_blocks)
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up, of which cached
        self.steps = 0
        self.busy = 0.0
        self.generated = 0

    def info(self) -> dict:
        return {"model": FAKE_MODEL_NAME, "max_model_len": self.max_model_len,
                "vocab_size": self.tokenizer.vocab_size, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                "device": "fake", "eos_token_ids": list(self.tokenizer.eos_token_ids),
                "model_id": self.model_id}

    def snapshot(self) -> dict:
        running = self._running()
        used = sum(-(-(len(r.prompt) + len(r.output)) // self.block_size) for r in running)
        return {"running": len(running), "waiting": len(self.requests) - len(running),
                "kv_blocks_used": used, "kv_blocks_total": self.num_blocks,
                "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "prefix_evictions": self.cache.evictions,
                "steps": self.steps, "busy_seconds": self.busy, "preemptions": 0,
                "prompt_tokens": 0, "generation_tokens": self.generated}

    @property
    def kv_capacity_tokens(self) -> int:
        """As the model engine's: its simulated pool, which the Ready frame reports."""
        return self.num_blocks * self.block_size

    def validate(self, request_id, prompt, params, priority=0, cache_salt=None) -> None:
        validate_request(request_id, prompt, params, priority, cache_salt,
                         vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len,
                         kv_capacity_tokens=self.kv_capacity_tokens)
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine",
                                        param="request_id")

    def add_request(self, request_id, prompt_token_ids, params=SamplingParams(), priority=0,
                    cache_salt=None, arrival_time=None) -> None:
        self.validate(request_id, prompt_token_ids, params, priority, cache_salt)
        prompt = list(prompt_token_ids)
        hashes = block_hashes(root_hash(self.model_id, cache_salt), prompt, self.block_size)
        cached = self._cached_prefix(prompt, hashes, reads=params.prompt_logprobs is None)
        self.requests[request_id] = _FakeRequest(
            request_id, prompt, params, priority,
            arrival_time if arrival_time is not None else time.monotonic(), cached,
            IncrementalDetokenizer(self.tokenizer, stop=params.stop), cache_salt, hashes,
            script=self._script(params), thought=self._thought(prompt, params))

    def _thought(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The scripted think block of a prompt that opened one (module docstring)."""
        if not self.tokenizer.decode(prompt[-8:], skip_special_tokens=False
                                     ).rstrip().endswith("<think>"):
            return []
        thought = self.tokenizer.encode(THOUGHT)
        if params.reasoning_budget is not None:
            thought = thought[:params.reasoning_budget]
        return thought + self.tokenizer.encode(THOUGHT_END)

    def _script(self, params: SamplingParams) -> list[int] | None:
        spec = params.structured
        if spec is None or spec["type"] != "choice" or not self.tokenizer.eos_token_ids:
            return None
        return self.tokenizer.encode(spec["choices"][0]) + [self.tokenizer.eos_token_ids[0]]

    def _cached_prefix(self, prompt: list[int], hashes: list[bytes], reads: bool = True) -> int:
        """Tokens served by cached blocks (0 unless `reads`), leaving the last token to compute;
        every full block of the prompt is cached now."""
        hits = 0
        if reads:
            usable = hashes[:(len(prompt) - 1) // self.block_size]
            hits = self.cache.num_leading(usable) * self.block_size
            self.prefix_queries += len(prompt)
            self.prefix_hits += hits
        self.cache.use(hashes)
        return hits

    def _release(self, r: _FakeRequest) -> None:
        """The request ends: its blocks go back to the cache, with its output's full blocks
        (all but the last token, whose KV a model never computes)."""
        tokens = r.prompt + r.output[:-1]
        self.cache.use(block_hashes(root_hash(self.model_id, r.salt), tokens, self.block_size,
                                    r.hashes))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        self._release(r)
        return self._output(r, [], "", "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _running(self) -> list[_FakeRequest]:
        order = sorted(self.requests.values(), key=lambda r: (r.priority, r.arrival))
        return order[:self.max_num_seqs]

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        start = time.perf_counter()
        running = self._running()
        uncached = sum(len(r.prompt) - r.cached for r in running if not r.output)
        self.sleep(self.step_seconds + self.prefill_seconds_per_token * uncached)
        outputs = []
        for r in running:
            token = self._next_token(r)
            r.output.append(token)
            r.first_token = r.first_token or time.monotonic()
            text = r.detok.push([token])
            stopped = r.detok.stopped or token in r.params.stop_token_set or (
                r.script is not None and len(r.output) == len(r.thought) + len(r.script))
            reason = "stop" if stopped else (
                "length" if len(r.output) >= r.params.max_tokens else None)
            if reason == "length":
                text += r.detok.flush()
            if reason:
                del self.requests[r.request_id]
                self._release(r)
            outputs.append(self._output(r, [token], text, reason))
        self.steps += 1
        self.generated += len(running)
        seconds = time.perf_counter() - start
        self.busy += seconds
        stats = StepStats(len(running), 0, len(running), seconds, 0, self.num_blocks,
                          len(running), len(self.requests) - len(running))
        return outputs, stats

    def _next_token(self, r: _FakeRequest) -> int:
        if len(r.output) < len(r.thought):
            return r.thought[len(r.output)]
        if r.script is not None:
            return r.script[len(r.output) - len(r.thought)]
        return self.words[(len(r.output) - len(r.thought)) % len(self.words)]

    def _output(self, r: _FakeRequest, tokens, text, reason) -> RequestOutput:
        logprobs = None
        if r.params.logprobs or r.params.top_logprobs:
            top = tuple((t, -0.1 * (i + 1)) for i, t in enumerate(tokens * r.params.top_logprobs))
            logprobs = [TokenLogprob(t, -0.1, top) for t in tokens]
        timing = None
        if reason is not None:
            timing = {"arrival": wall_clock(r.arrival), "scheduled": wall_clock(r.arrival),
                      "first_token": wall_clock(r.first_token), "finished": time.time(),
                      "preemptions": 0}
        stop_reason = None
        if reason == "stop":
            stop_reason = r.detok.stop_reason if r.detok.stopped else r.output[-1]
        return RequestOutput(r.request_id, tokens, text, reason is not None, reason,
                             Usage(len(r.prompt), r.cached, len(r.output)), logprobs,
                             stop_reason, timing, self._prompt_logprobs(r, tokens))

    def _prompt_logprobs(self, r: _FakeRequest, tokens) -> list[PromptLogprob | None] | None:
        """On the first output with tokens only: each prompt token the fake's most likely."""
        k = r.params.prompt_logprobs
        if k is None or not tokens or len(r.output) != len(tokens):
            return None
        vocab = self.tokenizer.vocab_size
        return [None] + [PromptLogprob(t, -0.1, 1, tuple(((t + j) % vocab, -0.1 * (j + 1))
                                                         for j in range(k)))
                         for t in r.prompt[1:]]

    def drain_kv_events(self) -> KvEvents | None:
        """Blocks the simulated cache stored and evicted since the last call, or None."""
        return self.cache.events.drain()

    def kv_snapshot(self) -> KvEvents:
        """Every block the simulated cache holds now, as a frame that replaces a view."""
        return self.cache.events.snapshot()

    def close(self) -> None:
        pass
