"""The reasoning budget (`SamplingParams.reasoning_budget`, the API's max_reasoning_tokens and
reasoning_effort): a reasoning model that has thought that many tokens inside `<think>` ...
`</think>` without closing the block gets the end marker's tokens appended for it, and
generation goes on from there, now writing its answer.

The engine appends them the way it appends a grammar's forced tokens (jump-forward,
runtime/engine.py `_append`): after the step's own tokens, without a forward pass each (their
KV is computed by the next step, like a prompt chunk), billed as output. So it works wherever
the engine runs (CPU, GPU, speculative decoding), and only the host's bookkeeping knows of it.

Where the think block is, read off bytes, not token ids, so that a marker written in several
tokens (a tokenizer without `<think>` as one token) counts as well:
- the output starts inside it when the prompt's text ends with `<think>` (the templates of
  DeepSeek-R1 and Qwen3 thinking-2507 end with `<think>\\n`: the same rule as the gateway's
  `prompt_opens_think`), else it enters when the output writes `<think>`;
- the tokens counted against the budget are those after the start marker, up to the end
  marker; the block happens once (after `</think>` nothing is counted).
A request with a grammar (structured outputs, a required tool call) whose prompt opened the
block thinks first, free: its grammar waits until the block closes (no mask, no jump-forward,
no proposals meanwhile; the marker's tokens are not the grammar's), then holds the answer.
Where the prompt opened none, the grammar holds from the first token and the output cannot
open one. A budget on such a request cuts the thought as on any other.
"""
from __future__ import annotations

from collections.abc import Callable

THINK_OPEN, THINK_CLOSE = b"<think>", b"</think>"
_TAIL = 64  # bytes of recent output kept to find a marker written in pieces
_PROMPT_TAIL_TOKENS = 8  # the prompt's end looked at for an open think block


class ThinkBudget:
    """One request's think-block bookkeeping: fed every token appended to its output."""

    def __init__(self, budget: int | None, end_ids: list[int],
                 token_bytes: Callable[[int], bytes], prompt_ids: list[int],
                 from_output: bool = True):
        self.budget = budget  # None: unbounded (the block is only tracked)
        self.end_ids = list(end_ids)
        self.token_bytes = token_bytes
        tail = b"".join(self._bytes(t) for t in prompt_ids[-_PROMPT_TAIL_TOKENS:])
        self.inside = tail.rstrip().endswith(THINK_OPEN)
        # the block closed (or, when the output may not open one, never was): nothing more
        # to count or force
        self.done = not (self.inside or from_output)
        self.used = 0  # tokens written inside the block so far
        self.tail = b""
        self.num_forced = 0  # end-marker tokens appended by the engine
        self.num_seen = 0  # output tokens accepted
        self.answer_start = 0 if self.done else -1  # output index of the answer's first token

    def _bytes(self, token: int) -> bytes:
        try:
            return self.token_bytes(token)
        except Exception:  # noqa: BLE001 - an id without bytes (a hole) writes nothing
            return b""

    @property
    def active(self) -> bool:
        """The budget may still force tokens: the engine must see each step's tokens
        before planning the next (no overlapped step)."""
        return not self.done

    @property
    def thinking(self) -> bool:
        return self.inside and not self.done

    def answer_tokens(self, output_ids: list[int]) -> list[int]:
        """The output tokens after the block (a grammar's to consume); none while thinking."""
        return output_ids[self.answer_start:] if self.answer_start >= 0 else []

    def accept(self, token: int) -> None:
        self.num_seen += 1
        if self.done:
            return
        self.tail = (self.tail + self._bytes(token))[-_TAIL:]
        if not self.inside:
            at = self.tail.find(THINK_OPEN)
            if at >= 0:
                self.inside, self.used = True, 0
                self.tail = self.tail[at + len(THINK_OPEN):]
            return
        if THINK_CLOSE in self.tail:
            self.inside, self.done = False, True
            self.answer_start = self.num_seen
            return
        self.used += 1

    @property
    def exhausted(self) -> bool:
        return self.thinking and self.budget is not None and self.used >= self.budget

    def forced_tokens(self, room: int) -> list[int]:
        """The end marker's tokens to append now (at most `room`), or none."""
        if not self.exhausted or room <= 0:
            return []
        forced = self.end_ids[:room]
        self.num_forced += len(forced)
        return forced


def think_budget(params, prompt_ids: list[int], tokenizer) -> ThinkBudget | None:
    """The request's think-block bookkeeping, or None: no budget and no grammar to defer, a
    grammar whose prompt opened no block, or a tokenizer that cannot write the end marker."""
    constrained = params.structured is not None
    if params.reasoning_budget is None and not constrained:
        return None
    end_ids = tokenizer.encode(THINK_CLOSE.decode())
    if not end_ids:
        return None
    think = ThinkBudget(params.reasoning_budget, end_ids, tokenizer.token_bytes, prompt_ids,
                        from_output=not constrained)
    return None if think.done else think


def grammar_waits(request) -> bool:
    """The request's grammar waits for its thought to close (module docstring)."""
    return request.grammar is not None and request.think is not None and \
        request.think.thinking
