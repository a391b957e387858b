"""What the engine asks of structured outputs: attach a grammar to a new request, learn each
step which compiles finished (or failed, or ran too long), wait for them when nothing else
can run, and the forced tokens to append after a request's new tokens (jump-forward).

A request whose compile fails after `add_request` returned is handed back by `poll` with its
error; the engine finishes it as "rejected" and the worker sends that as a `Rejected` frame,
the same refusal a bad request gets at once. So does a request whose matcher fails mid-output
(`broken`: llguidance's per-step limits, compiler.LIMITS), instead of ending "error" with
text that matches nothing.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING

from contract.errors import InvalidRequestError
from contract.structured_spec import spec_param
from runtime.structured.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    first_line,
    mask_vocab_size,
)
from runtime.structured.masks import MaskMaker
from runtime.structured.matcher import GrammarState

if TYPE_CHECKING:
    from contract.tokenizer import Tokenizer
    from runtime.scheduling.request import Request

COMPILE_TIMEOUT_S = 5.0  # a compile running longer than this refuses its request


class GrammarError(InvalidRequestError):
    """A structured-output spec that does not compile (bad schema, dangling $ref, an
    unsupported keyword, a bad regex or grammar) or compiles too slowly."""


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.masks = MaskMaker(mask_vocab_size(tokenizer, vocab_size))  # the runner's
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        self.compile_timeout_s = compile_timeout_s
        self.pending: dict[str, Request] = {}  # requests whose grammar is still compiling

    def attach(self, request: Request) -> None:
        """Start (or find) the compile of the request's grammar. Raises GrammarError at once
        for a spec already known not to compile; then nothing is attached."""
        params = request.params
        if params.structured is None:
            return
        param = spec_param(params.structured)
        if self.compiler.lltokenizer is None:
            raise self._error(param, "this model's tokenizer cannot be used for grammars "
                                     f"({self.compiler.unavailable})")
        job = self.compiler.submit(params.structured_key, params.structured)
        if job.done and isinstance(job.future.result(), str):
            raise self._error(param, job.future.result())
        request.grammar = GrammarState(job, param, params.jump_forward
                                       and not (params.logprobs or params.top_logprobs))
        self.pending[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def poll(self) -> list[tuple[Request, GrammarError]]:
        """Give every request whose compile finished its matcher; return those that cannot
        run (the compile failed or is past its time limit) with their errors."""
        now, failed = time.monotonic(), []
        for rid, request in list(self.pending.items()):
            grammar = request.grammar
            assert grammar is not None
            job = grammar.job
            if job.done:
                del self.pending[rid]
                error = self._start(request, job.future.result())
            elif job.running_for(now) > self.compile_timeout_s:
                del self.pending[rid]
                error = self._error(grammar.param, f"it took longer than "
                                                   f"{self.compile_timeout_s:g} s to compile")
            else:
                continue
            if error is not None:
                failed.append((request, error))
        return failed

    def _start(self, request: Request, result: CompiledGrammar | str) -> GrammarError | None:
        grammar = request.grammar
        assert grammar is not None
        if isinstance(result, str):
            return self._error(grammar.param, result)
        think = request.think  # a thought before the answer is not the grammar's
        tokens = request.output_token_ids if think is None else \
            think.answer_tokens(request.output_token_ids)
        if not grammar.start(result, tokens):
            return self._error(grammar.param, "the tokens already generated do not match it")
        return None

    def broken(self, request: Request) -> GrammarError:
        """The refusal of a request whose matcher failed mid-output (a mask or jump-forward
        past llguidance's per-step limits)."""
        grammar = request.grammar
        assert grammar is not None
        return self._error(grammar.param, "its output could not be computed within this "
                                          f"server's limits ({first_line(grammar.error)})")

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes: for steps with nothing
        else to run, so the worker does not spin while grammars compile."""
        futures = [r.grammar.job.future for r in self.pending.values() if r.grammar]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def jump_forward(self, request: Request, max_model_len: int) -> list[int]:
        """The forced tokens to append now, within max_tokens and the context (none for a
        request without a grammar or that opted out, or one asking for logprobs: those get
        one sampled distribution per token)."""
        grammar = request.grammar
        if grammar is None or not grammar.jump_forward:
            return []
        room = min(request.params.max_tokens - request.num_output_tokens,
                   max_model_len - request.num_tokens)
        forced = grammar.forced_tokens(self.eos_token_id, room)
        grammar.num_forced += len(forced)
        return forced

    @staticmethod
    def _error(param: str, reason: str) -> GrammarError:
        return GrammarError(f"the structured-output spec was refused: {reason}", param=param)
