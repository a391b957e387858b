"""A deterministic stand-in for LLMEngine with the same worker-facing surface (`EngineCore`,
runtime/engine_core.py) and no model.

Gateway tests and benchmarks use it where the model's speed would only add noise. It uses the
real SmolLM2 tokenizer (read from the GGUF metadata, no weights), emits a fixed cycle of word
tokens, one per running request per step, after `step_seconds` of simulated work, honours
max_tokens, stop strings, stop token ids, priorities and max_num_seqs, and reports cached
tokens as the block-aligned longest prefix it has already seen under the same salt (none for
a request asking for prompt logprobs, which reads no cache, as in the model engine).

Structured outputs: a `choice` spec makes it emit the first choice's tokens and then the
end-of-sequence token (finish "stop", as the model engine ends a complete grammar); other
specs (json, regex, grammar) are accepted and ignored: the word cycle matches none of them.
`jump_forward` changes nothing here.

Its fake distribution always makes the token it names the most likely at logprob -0.1, the
n-th alternative at -0.1 * n: so for sampled tokens and for prompt tokens alike (rank 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.detokenizer import IncrementalDetokenizer
from runtime.errors import DuplicateRequestError
from runtime.model_files import FAKE_MODEL_NAME
from runtime.outputs import PromptLogprob, RequestOutput, StepStats, TokenLogprob, Usage, wall_clock
from runtime.sampling_params import SamplingParams
from runtime.validate import validate_request

WORDS = " The quick brown fox jumps over the lazy dog and keeps running through the field."


@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    cached: int
    detok: IncrementalDetokenizer
    output: list[int] = field(default_factory=list)
    first_token: float | None = None
    script: list[int] | None = None  # the tokens a choice spec makes it emit, then stop


class FakeEngine:
    def __init__(self, tokenizer=None, *, step_seconds: float = 0.002, max_num_seqs: int = 64,
                 max_model_len: int = 8192, block_size: int = 16, num_blocks: int = 4096):
        if tokenizer is None:
            from runtime.gguf_loader import read_gguf_tokenizer
            from runtime.loader import default_model_path
            tokenizer = read_gguf_tokenizer(default_model_path())
        self.tokenizer = tokenizer
        self.step_seconds = step_seconds
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.words = tokenizer.encode(WORDS)
        self.requests: dict[str, _FakeRequest] = {}
        self.seen_blocks: set[int] = set()  # hashes of chained block keys
        self.steps = 0
        self.busy = 0.0
        self.generated = 0

    def info(self) -> dict:
        return {"model": FAKE_MODEL_NAME, "max_model_len": self.max_model_len,
                "vocab_size": self.tokenizer.vocab_size, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                "device": "fake", "eos_token_ids": list(self.tokenizer.eos_token_ids)}

    def snapshot(self) -> dict:
        running = self._running()
        used = sum(-(-(len(r.prompt) + len(r.output)) // self.block_size) for r in running)
        return {"running": len(running), "waiting": len(self.requests) - len(running),
                "kv_blocks_used": used, "kv_blocks_total": self.num_blocks,
                "prefix_queries": 0, "prefix_hits": 0, "prefix_evictions": 0,
                "steps": self.steps, "busy_seconds": self.busy, "preemptions": 0,
                "prompt_tokens": 0, "generation_tokens": self.generated}

    def validate(self, request_id, prompt, params, priority=0, cache_salt=None) -> None:
        validate_request(request_id, prompt, params, priority, cache_salt,
                         vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len,
                         kv_capacity_tokens=self.num_blocks * self.block_size)
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine",
                                        param="request_id")

    def add_request(self, request_id, prompt_token_ids, params=SamplingParams(), priority=0,
                    cache_salt=None, arrival_time=None) -> None:
        self.validate(request_id, prompt_token_ids, params, priority, cache_salt)
        cached = self._cached_prefix(list(prompt_token_ids), cache_salt,
                                     reads=params.prompt_logprobs is None)
        self.requests[request_id] = _FakeRequest(
            request_id, list(prompt_token_ids), params, priority,
            arrival_time if arrival_time is not None else time.monotonic(), cached,
            IncrementalDetokenizer(self.tokenizer, stop=params.stop),
            script=self._script(params))

    def _script(self, params: SamplingParams) -> list[int] | None:
        spec = params.structured
        if spec is None or spec["type"] != "choice" or not self.tokenizer.eos_token_ids:
            return None
        return self.tokenizer.encode(spec["choices"][0]) + [self.tokenizer.eos_token_ids[0]]

    def _cached_prefix(self, prompt: list[int], salt, reads: bool = True) -> int:
        """Tokens served by blocks seen before (0 unless `reads`); every block is seen now."""
        bs, hits, key = self.block_size, 0, (salt,)
        for i in range(len(prompt) // bs):
            key = key + tuple(prompt[i * bs:(i + 1) * bs])
            if reads and hash(key) in self.seen_blocks and (i + 1) * bs < len(prompt):
                hits = (i + 1) * bs
            self.seen_blocks.add(hash(key))
        return hits

    def abort_request(self, request_id: str) -> RequestOutput | None:
        r = self.requests.pop(request_id, None)
        return None if r is None else self._output(r, [], "", "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _running(self) -> list[_FakeRequest]:
        order = sorted(self.requests.values(), key=lambda r: (r.priority, r.arrival))
        return order[:self.max_num_seqs]

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        start = time.perf_counter()
        time.sleep(self.step_seconds)
        outputs = []
        running = self._running()
        for r in running:
            token = self._next_token(r)
            r.output.append(token)
            r.first_token = r.first_token or time.monotonic()
            text = r.detok.push([token])
            stopped = r.detok.stopped or token in r.params.stop_token_set or (
                r.script is not None and len(r.output) == len(r.script))
            reason = "stop" if stopped else (
                "length" if len(r.output) >= r.params.max_tokens else None)
            if reason == "length":
                text += r.detok.flush()
            if reason:
                del self.requests[r.request_id]
            outputs.append(self._output(r, [token], text, reason))
        self.steps += 1
        self.generated += len(running)
        seconds = time.perf_counter() - start
        self.busy += seconds
        stats = StepStats(len(running), 0, len(running), seconds, 0, self.num_blocks,
                          len(running), len(self.requests) - len(running))
        return outputs, stats

    def _next_token(self, r: _FakeRequest) -> int:
        if r.script is not None:
            return r.script[len(r.output)]
        return self.words[len(r.output) % len(self.words)]

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

    def close(self) -> None:
        pass
