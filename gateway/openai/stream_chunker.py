"""Turn one request's per-choice text deltas into OpenAI stream chunks, in OpenAI's order.

chat, per choice: a first chunk with delta {"role": "assistant", "content": ""}, then content
deltas, then an empty delta carrying finish_reason.
chat with tools offered: the first delta's content is null, the output is read for tool calls
(gateway/openai/tool_stream.py), each `delta.tool_calls` entry goes in a chunk of its own, and
a choice that called tools and ended by itself finishes with "tool_calls".
chat from a reasoning model (a reasoning parser, gateway/openai/reasoning.py): the text
between its think markers goes out as delta {"reasoning_content", "reasoning"} (DeepSeek's and
vLLM's names), the rest as content; only the content is read for tool calls. Each choice's
tokens are counted as reasoning when its delta began inside the reasoning or opened it (a delta
that straddles the end marker counts whole: its tokens up to and including the marker are
reasoning, and what follows the marker in the same delta rides along): `reasoning_tokens`.
completion, per choice: text deltas, then an empty text carrying finish_reason.
With stream_options.include_usage, every chunk carries "usage": null and `usage()` gives one last
chunk with no choices and the whole request's usage, as OpenAI's server does.

Chunks are typed (gateway/openai/schema/answers.py) but are the plain dicts orjson writes: the
per-token path makes no object beyond them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from gateway.openai.json_calls import Parsed
from gateway.openai.reasoning import ReasoningSplit, reasoning_split_for, split_piece
from gateway.openai.responses import (
    LogprobToken,
    chat_chunk,
    chat_logprobs,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_usage_chunk,
)
from gateway.openai.schema.answers import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChunkDelta,
    Completion,
    FinishReason,
    Usage,
)
from gateway.openai.tool_stream import finish_reason, reader_for
from gateway.openai.tools import ToolSpec

Chunk = ChatCompletionChunk | Completion  # a chat stream's, or a completion stream's
C = TypeVar("C", ChatCompletionChunk, Completion)


class StreamChunker:
    """Chunk builder for one streamed request; remembers each choice's text offset."""

    def __init__(self, kind: str, id: str, model: str, created: int,
                 include_usage: bool = False, echo: str | None = None,
                 tools: ToolSpec | None = None, reasoning: str | None = None,
                 prompt_opens_think: bool = False, tool_parser: str = "auto",
                 splitter: Callable[[], ReasoningSplit | None] | None = None):
        self.kind = kind
        self.id = id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.echo = echo  # completions with echo: the prompt, sent first in each choice
        self._chars_sent: dict[int, int] = {}  # per choice: for completions' text_offset
        self._started: set[int] = set()
        self.tools = tools if kind == "chat" else None
        self._readers: dict[int, object] = {}  # per choice, when its output may hold calls
        # each choice's reasoning splitter: `splitter()`, else the parser's
        self.splitter = splitter if kind == "chat" and splitter is not None else (
            lambda: reasoning_split_for(reasoning if kind == "chat" else None,
                                        prompt_opens_think))
        self.tool_parser = tool_parser  # the family syntax tool_choice auto reads
        self._splits: dict[int, ReasoningSplit | None] = {}  # per choice
        self.reasoning_tokens = 0  # every choice's, for completion_tokens_details

    def chunks(self, delta) -> list[Chunk]:
        """Every chunk one choice delta (gateway.serving.service.ChoiceDelta) becomes, in order: the
        SSE stream and the WebSocket send exactly these."""
        i = delta.index
        out: list[Chunk] = []
        if i not in self._started:
            self._started.add(i)
            out += self.start(i)
            if self.echo:
                out.append(self.delta(i, self.echo))
        split = self.split(i)
        if split is not None:
            return out + self._split_chunks(i, split, delta)
        reader = self.reader(i)
        if reader is not None:
            return out + self._tool_chunks(i, reader, delta)
        if delta.text or delta.logprobs:
            out.append(self.delta(i, delta.text, delta.logprobs))
        if delta.finish_reason is not None:
            out.append(self.finish(i, delta.finish_reason))
        return out

    def reader(self, index: int):
        """The tool-call reader of choice `index` (None: its output is plain content)."""
        if index not in self._readers:
            self._readers[index] = reader_for(self.tools, parser=self.tool_parser)
        return self._readers[index]

    def split(self, index: int) -> ReasoningSplit | None:
        """The reasoning splitter of choice `index` (None: no reasoning parser)."""
        if index not in self._splits:
            self._splits[index] = self.splitter()
        return self._splits[index]

    def _split_chunks(self, i: int, split: ReasoningSplit, delta) -> list[ChatCompletionChunk]:
        """A reasoning model's delta: its reasoning, then its content (read for tool calls
        when tools were offered), the tokens' logprobs on the first chunk, then the end."""
        reasoning, content, inside = split_piece(split, delta.text,
                                                 delta.finish_reason is not None)
        self.reasoning_tokens += len(delta.token_ids) if inside else 0
        out = [self._chat(i, reasoning_delta(reasoning), None)] if reasoning else []
        reader = self.reader(i)
        reason = delta.finish_reason
        if reader is not None:
            parsed = reader.feed(content)
            if reason is not None:
                parsed.extend(reader.finish())
            out += self._parsed_chunks(i, parsed)
            reason = finish_reason(reason, reader) if reason is not None else None
        elif content:
            out.append(self._chat(i, {"content": content}, None))
        self._attach_logprobs(i, out, delta.logprobs)
        if reason is not None:
            out.append(self._chat(i, {}, cast(FinishReason, reason)))
        return out

    def _tool_chunks(self, i: int, reader, delta) -> list[ChatCompletionChunk]:
        parsed = reader.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.extend(reader.finish())
        out = self._parsed_chunks(i, parsed)
        self._attach_logprobs(i, out, delta.logprobs)
        if delta.finish_reason is not None:
            reason = cast(FinishReason, finish_reason(delta.finish_reason, reader))  # once
            out.append(self._chat(i, {}, reason))
        return out

    def _attach_logprobs(self, i: int, out: list[ChatCompletionChunk], logprobs) -> None:
        """The tokens' logprobs ride on the first chunk they produced (a chunk of their own
        where they produced none)."""
        if not logprobs:
            return
        formatted = chat_logprobs(logprobs)
        if out:
            out[0]["choices"][0]["logprobs"] = formatted
        else:
            out.append(self._chat(i, {}, None, formatted))

    def _parsed_chunks(self, i: int, parsed: Parsed) -> list[ChatCompletionChunk]:
        out = [self._chat(i, {"content": parsed.content}, None)] if parsed.content else []
        return out + [self._chat(i, {"tool_calls": [entry]}, None)
                      for entry in parsed.tool_calls]

    def start(self, index: int) -> list[Chunk]:
        """Chunks to send before choice `index`'s first token: the role, for chat."""
        if self.kind != "chat":
            return []
        content = None if self.reader(index) is not None else ""
        return [self._chat(index, {"role": "assistant", "content": content}, None)]

    def delta(self, index: int, text: str,
              logprobs: Sequence[LogprobToken] | None = None) -> Chunk:
        """A chunk with new text of choice `index` (and its tokens' logprobs when asked for)."""
        offset = self._chars_sent.get(index, 0)
        self._chars_sent[index] = offset + len(text)
        if self.kind == "chat":
            chat = None if logprobs is None else chat_logprobs(logprobs)
            return self._chat(index, {"content": text}, None, chat)
        legacy = None if logprobs is None else completion_logprobs(logprobs, offset)
        return self._marked(completion_chunk(self.id, self.model, self.created, index, text,
                                             None, legacy))

    def finish(self, index: int, finish_reason: FinishReason) -> Chunk:
        """The chunk that ends choice `index`: no new text, just why it stopped."""
        if self.kind == "chat":
            return self._chat(index, {}, finish_reason)
        return self._marked(completion_chunk(self.id, self.model, self.created, index, "",
                                             finish_reason))

    def usage(self, usage: Usage) -> list[Chunk]:
        """The closing usage chunk, if the client asked for one."""
        if not self.include_usage:
            return []
        if self.kind == "chat":
            return [chat_usage_chunk(self.id, self.model, self.created, usage)]
        return [completion_usage_chunk(self.id, self.model, self.created, usage)]

    def _chat(self, index: int, delta: ChunkDelta, finish_reason: FinishReason,
              logprobs: ChatLogprobs | None = None) -> ChatCompletionChunk:
        return self._marked(chat_chunk(self.id, self.model, self.created, index, delta,
                                       finish_reason, logprobs))

    def _marked(self, chunk: C) -> C:
        if self.include_usage:
            chunk["usage"] = None  # OpenAI marks every chunk but the last this way
        return chunk


def reasoning_delta(text: str) -> ChunkDelta:
    """A chunk's delta of reasoning text, under DeepSeek's name and vLLM's."""
    return {"reasoning_content": text, "reasoning": text}
