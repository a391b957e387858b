"""Reasoning apart from the answer: what a reasoning model writes between `<think>` and
`</think>` becomes `reasoning_content` (DeepSeek's name; vLLM's `reasoning`), the rest
`content`, piece by piece for streams and whole answers alike.

One `ReasoningSplit` per choice: `feed(text)` for each new piece of output returns (new
reasoning text, new content text); `finish()` at the end flushes what it held. It is
streaming-safe: a marker split across pieces never leaks into either side, because a possible
partial marker (and whitespace that may turn out to border a marker) is held until decided.
Feeding an output in any pieces gives exactly what feeding it whole gives.

Parsers (`--reasoning-parser`, `auto` picks one from the chat template: `parser_for_template`):
- `deepseek-r1`: DeepSeek-R1 and its distills. Their template ends the prompt with `<think>\\n`,
  so the output starts inside the reasoning, whether or not the prompt opened it (vLLM's
  reading); a `<think>` the model writes itself at the start is dropped.
- `qwen3`: Qwen3 writes `<think>` itself at the start of its answer, or not at all (thinking
  off: then the whole answer is content); a template that opens the think block in the prompt
  (Qwen3 thinking-2507, `prompt_opens_think`) starts it inside the reasoning.
- `none` (or no parser): everything is content, as before.

Edge cases, decided:
- No end marker before the output ends (cut by max_tokens, or a model that never closes):
  everything after the start is reasoning and `content` is empty, as DeepSeek's API and vLLM's
  deepseek_r1 parser answer. A stream has already sent it as reasoning, so the whole answer
  must agree: nothing is moved back to content at the end.
- The start marker counts only at the very start of the output (after white space); a
  `<think>` later in the answer, or any marker after the reasoning ended, is content as
  written. The reasoning happens once.
- A constrained request (structured output, a required or named tool call) thinks only where
  the prompt opened the block: the worker's grammar waits for it to close and holds from the
  first token otherwise (gateway/http/completions.py `reasoning_split_of`).
- White space bordering the markers is not text: reasoning is stripped at both ends, and the
  content after `</think>` starts at its first non-space character (R1 writes
  `<think>\\n...\\n</think>\\n\\n`). An answer without reasoning keeps its text exactly.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("deepseek-r1", "qwen3", "none")
# what `--reasoning-parser` takes beside the parsers: pick from the model's chat template
AUTO = "auto"

_OPENING, _REASONING, _AFTER, _CONTENT = "opening", "reasoning", "after", "content"


class ReasoningSplit:
    """The reasoning/content split of one choice's output (module docstring)."""

    def __init__(self, starts_in_reasoning: bool, start: str = THINK_OPEN,
                 end: str = THINK_CLOSE):
        self.starts_in_reasoning = starts_in_reasoning
        self.start, self.end = start, end
        self.phase = _OPENING  # until the output has shown whether it opens with `start`
        self.pending = ""  # undecided text: a possible marker's start, or border white space
        self.reasoning_started = False  # some reasoning text went out (its left side is cut)
        self.content_started = False  # some content text went out after the end marker

    @property
    def in_reasoning(self) -> bool:
        """Inside the reasoning now (before the output showed its start: whether it starts
        there). A piece fed while this was true, or that made it true, is reasoning."""
        if self.phase == _OPENING:
            return self.starts_in_reasoning
        return self.phase == _REASONING

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        if self.phase == _OPENING and not self._open(final=False):
            return "", ""
        if self.phase == _REASONING:
            reasoning = self._reasoning(final=False)
        if self.phase == _AFTER:
            content = self._after()
        elif self.phase == _CONTENT:
            content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        reasoning, content = "", ""
        if self.phase == _OPENING:
            self._open(final=True)
        if self.phase == _REASONING:
            reasoning = self._reasoning(final=True)
        if self.phase == _AFTER:
            content = self._after()
        elif self.phase == _CONTENT:
            content = self.pending
        self.pending = ""
        return reasoning, content

    def _open(self, final: bool) -> bool:
        """Decide whether the output opens with the start marker; False: not yet known."""
        rest = self.pending.lstrip()
        if rest.startswith(self.start):
            self.pending = rest[len(self.start):]
            self.phase = _REASONING
            return True
        if self.start.startswith(rest) and not final:
            return False  # white space, or a piece of the marker: wait for more
        self.phase = _REASONING if self.starts_in_reasoning else _CONTENT
        return True

    def _reasoning(self, final: bool) -> str:
        """The reasoning text decided now; moves past the end marker when it is here."""
        at = self.pending.find(self.end)
        if at >= 0:
            body, self.pending = self.pending[:at], self.pending[at + len(self.end):]
            self.phase = _AFTER
            return self._reasoning_text(body.rstrip())
        if final:
            body, self.pending = self.pending, ""
            return self._reasoning_text(body.rstrip())
        cut = len(self.pending) - _marker_prefix(self.pending, self.end)
        body = self.pending[:cut].rstrip()  # white space before a marker is held too
        self.pending = self.pending[len(body):]
        return self._reasoning_text(body)

    def _reasoning_text(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _after(self) -> str:
        """Content after the end marker: from its first non-space character on."""
        text, self.pending = self.pending, ""
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text


def split_piece(split: ReasoningSplit, text: str, last: bool) -> tuple[str, str, bool]:
    """One delta of a choice through its splitter (flushed when it is the `last`): (its
    reasoning, its content, whether its tokens count as reasoning). They do when the delta
    began inside the reasoning or opened it, so a delta that straddles the end marker counts
    whole as reasoning: its tokens up to and including the marker are, and what follows the
    marker in the same delta (a token or two) rides along. Streams and whole answers both
    count this way, so they report the same reasoning_tokens."""
    began_inside = split.in_reasoning
    reasoning, content = split.feed(text)
    if last:
        more_reasoning, more_content = split.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning, content, began_inside or split.in_reasoning


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def prompt_opens_think(prompt_text: str | None, start: str = THINK_OPEN) -> bool:
    """The rendered prompt ends inside an open think block (DeepSeek-R1's and Qwen3
    thinking-2507's templates end with `<think>\\n`). Only the end is looked at: the end of a
    chat prompt is the template's generation prompt, never a client's text."""
    return bool(prompt_text) and prompt_text.rstrip().endswith(start)


def reasoning_split_for(parser: str | None,
                        prompt_opens_think: bool = False) -> ReasoningSplit | None:
    """The splitter of one choice under `parser` (None or "none": no splitting)."""
    if parser is None or parser == "none":
        return None
    if parser == "deepseek-r1":
        return ReasoningSplit(starts_in_reasoning=True)
    if parser == "qwen3":
        return ReasoningSplit(starts_in_reasoning=prompt_opens_think)
    raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(PARSERS)}")


# DeepSeek's chat templates write their roles with full-width bars: <｜User｜>, <｜Assistant｜>
_DEEPSEEK_MARK = "｜Assistant｜"


def parser_for_template(template: str | None) -> str:
    """`auto`: the parser a chat template calls for. A template that mentions `<think>` (or
    `</think>`, which R1's uses to drop earlier turns' reasoning) belongs to a reasoning model:
    DeepSeek's (its full-width role markers) gets deepseek-r1, any other qwen3, whose reading
    (reasoning only where the output or the prompt opens it) assumes least. Else none."""
    if not template or (THINK_OPEN not in template and THINK_CLOSE not in template):
        return "none"
    return "deepseek-r1" if _DEEPSEEK_MARK in template else "qwen3"


def resolve_parser(setting: str | None, template: str | None) -> str:
    """The parser `--reasoning-parser` names (auto: the template's)."""
    if setting is None or setting == AUTO:
        return parser_for_template(template)
    if setting not in PARSERS:
        raise ValueError(f"unknown reasoning parser {setting!r}; one of auto, "
                         f"{', '.join(PARSERS)}")
    return setting


__all__ = ["AUTO", "PARSERS", "THINK_CLOSE", "THINK_OPEN", "ReasoningSplit",
           "parser_for_template", "prompt_opens_think", "reasoning_split_for", "resolve_parser",
           "split_piece"]
