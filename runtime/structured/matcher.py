"""One request's grammar: bookkeeping beside the request, no tensors.

Until its compile is done the request has only the compile job (the scheduler runs its prompt
but never the step that samples). Then it has a matcher that has consumed exactly the
request's output tokens: the engine feeds it every token it appends, sampled or forced.
Speculative proposals never reach it: their masks are computed by advancing a matcher over
the proposals and rolling it back (runtime/structured/masks.py), so only accepted tokens are
ever consumed, and a rejected proposal leaves nothing to undo.
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance

from runtime.structured.compiler import CompiledGrammar, CompileJob


@dataclass
class GrammarState:
    job: CompileJob
    param: str  # the API parameter errors about this grammar name
    jump_forward: bool  # append forced tokens without sampling them
    matcher: llguidance.LLMatcher | None = None
    num_forced: int = 0  # output tokens appended by jump-forward (billed like any other)

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def start(self, compiled: CompiledGrammar, output_token_ids: list[int]) -> bool:
        """Make the matcher and feed it the tokens already output (a request imported after
        another worker sampled its first tokens); False if they do not match the grammar."""
        self.matcher = compiled.new_matcher()
        return all(self.matcher.consume_token(t) for t in output_token_ids)

    def accept(self, token: int) -> bool:
        """Consume an appended token; False (and the matcher in error) if the grammar does
        not allow it, which masked sampling never produces."""
        assert self.matcher is not None
        return self.matcher.consume_token(token)

    @property
    def is_error(self) -> bool:
        return self.matcher is not None and self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else ""

    def forced_tokens(self, eos_token_id: int, room: int) -> list[int]:
        """The tokens the grammar allows as the only continuation, at most `room` of them:
        llguidance's fast-forward tokens (forced bytes tokenized so that no token could have
        merged across the boundary with what follows), or the end-of-sequence token once the
        grammar can take nothing else."""
        m = self.matcher
        if room <= 0 or m is None or m.is_error():
            return []
        if m.is_stopped():
            return [eos_token_id]
        forced = m.compute_ff_tokens()[:room]
        return [] if m.is_error() else forced  # past its limits: the engine refuses it
