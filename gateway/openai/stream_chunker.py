"""Turn one request's per-choice text deltas into OpenAI stream chunks, in OpenAI's order.

chat, per choice: a first chunk with delta {"role": "assistant", "content": ""}, then content
deltas, then an empty delta carrying finish_reason.
completion, per choice: text deltas, then an empty text carrying finish_reason.
With stream_options.include_usage, every chunk carries "usage": null and `usage()` gives one last
chunk with no choices and the whole request's usage, as OpenAI's server does.
"""
from __future__ import annotations

from collections.abc import Sequence

from gateway.openai.responses import (
    LogprobToken,
    chat_chunk,
    chat_logprobs,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_usage_chunk,
)


class StreamChunker:
    """Chunk builder for one streamed request; remembers each choice's text offset."""

    def __init__(self, kind: str, id: str, model: str, created: int,
                 include_usage: bool = False, echo: str | None = None):
        self.kind = kind
        self.id = id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.echo = echo  # completions with echo: the prompt, sent first in each choice
        self._chars_sent: dict[int, int] = {}  # per choice: for completions' text_offset
        self._started: set[int] = set()

    def chunks(self, delta) -> list[dict]:
        """Every chunk one choice delta (gateway.serving.service.ChoiceDelta) becomes, in order: the
        SSE stream and the WebSocket send exactly these."""
        i, out = delta.index, []
        if i not in self._started:
            self._started.add(i)
            out += self.start(i)
            if self.echo:
                out.append(self.delta(i, self.echo))
        if delta.text or delta.logprobs:
            out.append(self.delta(i, delta.text, delta.logprobs))
        if delta.finish_reason is not None:
            out.append(self.finish(i, delta.finish_reason))
        return out

    def start(self, index: int) -> list[dict]:
        """Chunks to send before choice `index`'s first token: the role, for chat."""
        if self.kind != "chat":
            return []
        return [self._chunk(index, {"role": "assistant", "content": ""}, None)]

    def delta(self, index: int, text: str,
              logprobs: Sequence[LogprobToken] | None = None) -> dict:
        """A chunk with new text of choice `index` (and its tokens' logprobs when asked for)."""
        offset = self._chars_sent.get(index, 0)
        self._chars_sent[index] = offset + len(text)
        if self.kind == "chat":
            formatted = None if logprobs is None else chat_logprobs(logprobs)
            return self._chunk(index, {"content": text}, None, formatted)
        formatted = None if logprobs is None else completion_logprobs(logprobs, offset)
        return self._chunk(index, text, None, formatted)

    def finish(self, index: int, finish_reason: str) -> dict:
        """The chunk that ends choice `index`: no new text, just why it stopped."""
        return self._chunk(index, {} if self.kind == "chat" else "", finish_reason)

    def usage(self, usage: dict) -> list[dict]:
        """The closing usage chunk, if the client asked for one."""
        if not self.include_usage:
            return []
        build = chat_usage_chunk if self.kind == "chat" else completion_usage_chunk
        return [build(self.id, self.model, self.created, usage)]

    def _chunk(self, index: int, delta, finish_reason, logprobs: dict | None = None) -> dict:
        build = chat_chunk if self.kind == "chat" else completion_chunk
        chunk = build(self.id, self.model, self.created, index, delta, finish_reason, logprobs)
        if self.include_usage:
            chunk["usage"] = None  # OpenAI marks every chunk but the last this way
        return chunk
