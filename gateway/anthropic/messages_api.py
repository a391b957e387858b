"""Anthropic's Messages API read into a chat request, and its answer and stream events built
from the chat generation's output, as plain dicts.

The body is validated by its declaration (gateway/anthropic/schema.py), then becomes a chat
body that `parse_chat_request` validates, so the sampling checks, the model's defaults, the
tool paths and the chat template are exactly the chat endpoint's:

- system (a string or text blocks) -> a system message; text blocks of a turn are joined as
  chat joins parts (separate paragraphs);
- an assistant's tool_use blocks -> its `tool_calls` (arguments as compact JSON text), a
  user's tool_result blocks -> `tool` messages with `tool_call_id`, in the turn's order;
- tools -> function tools (input_schema as parameters); tool_choice auto / any / tool / none
  -> auto / required / a named function / none (any and tool are generated under the call's
  schema, as chat's required and named calls are), disable_parallel_tool_use ->
  parallel_tool_calls false;
- max_tokens, stop_sequences (-> stop), temperature, top_p, top_k, metadata.user_id (->
  user), stream;
- thinking enabled -> max_reasoning_tokens budget_tokens, disabled -> 0 (a reasoning model's
  end marker comes first), adaptive or absent -> the model's own way (output_config.effort ->
  reasoning_effort); output_config.format -> response_format (a JSON schema, generated
  under, as chat's). What a reasoning model writes in its
  think block (gateway/openai/reasoning.py, --reasoning-parser) becomes a thinking block
  (signature ""), the rest the text and tool_use blocks.

The answer's text is read by chat's own tool readers (gateway/openai/tool_stream.py): content
becomes a text block, each call a tool_use block (ids toolu_...).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, cast

import orjson

from gateway.anthropic.schema import (
    AnyChoice,
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    MessageUsage,
    NamedChoice,
    NoneChoice,
    StopReason,
    TextBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.errors import APIError
from gateway.openai.json_calls import Parsed
from gateway.openai.reasoning import ReasoningSplit
from gateway.openai.schema import read
from gateway.openai.schema.answers import ToolCall, Usage
from gateway.openai.tool_stream import collect, reader_for
from gateway.openai.tools import ToolSpec

PARAM_NAMES = {"stop": "stop_sequences", "user": "metadata.user_id",
               "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
               "reasoning_effort": "output_config.effort",
               "max_reasoning_tokens": "thinking.budget_tokens"}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def tool_reader(tools: ToolSpec | None, parser: str = "auto"):
    """Chat's reader of one answer's tool calls (None: plain text), its ids toolu_..."""
    return reader_for(tools, new_tool_use_id, parser=parser)


@dataclass(frozen=True)
class MessagesCall:
    """One validated Messages (or count_tokens) body: the chat body it becomes, and what the
    answer needs of it."""

    chat: dict  # the chat body, for parse_chat_request
    sources: tuple[str, ...]  # the Messages param each chat message came from
    stream: bool
    stop_sequences: tuple[str, ...]
    thinking_budget: int | None  # thinking enabled: its budget_tokens

    def renamed(self, exc: APIError) -> APIError:
        """A chat-side error under the Messages param it came from (messages[3] -> the turn
        it was made of, tools[0].function.parameters -> tools[0].input_schema, stop ->
        stop_sequences), so the client reads the names it sent."""
        if exc.param is None:
            return exc
        param = self._param_of(exc.param)
        if param == exc.param:
            return exc
        return APIError(exc.status, exc.message.replace(exc.param, param, 1), exc.type,
                        param, exc.code, exc.headers)

    def _param_of(self, param: str) -> str:
        if param in PARAM_NAMES:
            return PARAM_NAMES[param]
        match = re.fullmatch(r"messages\[(\d+)\].*", param)
        if match is not None and int(match[1]) < len(self.sources):
            return self.sources[int(match[1])]
        if param.startswith("response_format"):
            return "output_config.format"
        match = re.fullmatch(r"tools\[(\d+)\]\.function\.(\w+)(.*)", param)
        if match is not None:
            field = "input_schema" if match[2] == "parameters" else match[2]
            return f"tools[{match[1]}].{field}{match[3]}"
        return param


def parse_messages_request(body: Any) -> MessagesCall:
    req = read(MessagesRequest, body)
    call = _call(req, {"max_tokens": req.max_tokens, "stream": bool(req.stream)})
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "stop": req.stop_sequences or None,
                "user": req.metadata.user_id if req.metadata is not None else None}
    call.chat.update({k: v for k, v in sampling.items() if v is not None})
    output = req.output_config
    if output is not None and output.effort is not None and "max_reasoning_tokens" not in call.chat:
        call.chat["reasoning_effort"] = output.effort
    if output is not None and output.format is not None:
        call.chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output.format.schema_, "strict": True}}
    return call


def parse_count_tokens_request(body: Any) -> MessagesCall:
    return _call(read(CountTokensRequest, body), {})


def _call(req: CountTokensRequest, fields: dict) -> MessagesCall:
    messages, sources = _chat_messages(req)
    chat: dict[str, Any] = {"messages": messages, **fields}
    if req.model is not None:
        chat["model"] = req.model
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if getattr(choice, "disable_parallel_tool_use", None):
            chat["parallel_tool_calls"] = False
    thinking = req.thinking
    budget = thinking.budget_tokens if isinstance(thinking, ThinkingEnabled) else None
    if fields and isinstance(thinking, (ThinkingEnabled, ThinkingDisabled)):
        chat["max_reasoning_tokens"] = budget or 0  # disabled: the thinking is skipped
    stops = getattr(req, "stop_sequences", None) or ()
    return MessagesCall(chat, tuple(sources), bool(fields.get("stream")), tuple(stops), budget)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, AnyChoice):
        return "required"
    if isinstance(choice, NamedChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, NoneChoice):
        return "none"
    return "auto"


def _chat_messages(req: CountTokensRequest) -> tuple[list[dict], list[str]]:
    """The chat conversation, and the Messages param each of its messages came from."""
    out: list[dict] = []
    sources: list[str] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else "\n".join(
            b.text for b in req.system)
        out.append({"role": "system", "content": system})
        sources.append("system")
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        content = message.content
        if isinstance(content, str):
            out.append({"role": message.role, "content": content})
            sources.append(where)
        elif message.role == "assistant":
            texts = [b.text for b in content if isinstance(b, TextBlock)]
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": orjson.dumps(b.input).decode()}}
                for b in content if isinstance(b, ToolUseBlock)]
            turn: dict[str, Any] = {"role": "assistant",
                                    "content": "\n".join(texts) if texts or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
            sources.append(where)
        else:  # results become tool messages, the text between them user messages
            texts = []
            for block in content:
                if isinstance(block, ToolResultBlock):
                    if texts:
                        out.append({"role": "user", "content": "\n".join(texts)})
                        sources.append(where)
                        texts = []
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text()})
                    sources.append(where)
                elif isinstance(block, TextBlock):
                    texts.append(block.text)
            if texts or not content:
                out.append({"role": "user", "content": "\n".join(texts)})
                sources.append(where)
    return out, sources


# the answer

def message_usage(usage: Usage) -> MessageUsage:
    """Chat usage (what the bill charged, with our cost split) under Anthropic's names."""
    hit = usage["prompt_tokens_details"]["cached_tokens"]
    out: MessageUsage = {"input_tokens": usage["prompt_tokens"] - hit,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": hit,
                         "output_tokens": usage["completion_tokens"]}
    if "cost" in usage:
        out["cost"] = usage["cost"]
    return out


def opening_usage(prompt_tokens: int) -> MessageUsage:
    """message_start's usage: the prompt's tokens, before the worker said how many of them the
    prefix cache held (message_delta then carries the billed split, which the SDK keeps)."""
    return {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0}


def stop_reason(finish: str | None, called: bool, stop_sequence: str | None) -> StopReason:
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(decoded: str, text: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended an answer: `decoded` is all its tokens' text, the stop
    sequence included (the answer's `text` ends where it starts); None when none is there
    (the model's end-of-turn token ended it)."""
    found = [(abs(decoded.find(s) - len(text)), i, s) for i, s in enumerate(stops) if s in decoded]
    return min(found)[2] if found else None


def message_shell(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def message(shell: dict, content: list[ContentBlock], reason: StopReason | None,
            stop_sequence: str | None, usage: MessageUsage) -> Message:
    return cast(Message, {**shell, "content": content, "stop_reason": reason,
                          "stop_sequence": stop_sequence, "usage": usage})


def content_blocks(text: str, reader, split: ReasoningSplit | None = None) -> list[ContentBlock]:
    """A whole answer's blocks: its reasoning (with a reasoning parser), its text (none when
    empty), then a tool_use block per call, read by the stream's splitter and reader fed
    everything at once."""
    blocks: list[ContentBlock] = []
    if split is not None:
        thought, said = split.feed(text)
        more_thought, more_said = split.finish()
        thought, text = thought + more_thought, said + more_said
        if thought:
            blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if reader is None:
        return blocks + ([{"type": "text", "text": text}] if text else [])
    content, calls = collect(reader, text)
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [tool_use_block(call) for call in calls]
    return blocks


def tool_use_block(call: ToolCall) -> ContentBlock:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": tool_input(call["function"]["arguments"])}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; a call cut by max_tokens may
    be unfinished JSON: its input is then empty (stop_reason says max_tokens)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# stream events

class MessageEvents:
    """The stream events of one message in Anthropic's order: message_start and a ping, then
    content blocks (text_delta, input_json_delta for a tool_use block), then message_delta
    with the stop reason and the billed usage, then message_stop. Each method returns the
    events of one write."""

    def __init__(self, shell: dict, reader, prompt_tokens: int,
                 split: ReasoningSplit | None = None):
        self.shell = shell
        self.reader = reader  # chat's tool reader, or None for plain text
        self.split = split  # the reasoning splitter, or None for a model that does not think
        self.prompt_tokens = prompt_tokens
        self.index = -1  # the open block's index
        self.block: str | None = None  # the open block's type
        self.called = False

    def opening(self) -> list[dict]:
        start = {**self.shell, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": opening_usage(self.prompt_tokens)}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def delta(self, text: str) -> list[dict]:
        if self.split is None:
            return self._text(text)
        thought, said = self.split.feed(text)
        return self._thinking(thought) + self._text(said)

    def closing(self, finish: str | None, stop_sequence: str | None,
                usage: MessageUsage) -> list[dict]:
        """The rest of the text and the last block's end, then the message's."""
        events = []
        if self.split is not None:
            thought, said = self.split.finish()
            events += self._thinking(thought) + self._text(said)
        if self.reader is not None:
            events += self._events(self.reader.finish())
        events += self._close()
        reason = stop_reason(finish, self.called, stop_sequence)
        return [*events, {"type": "message_delta",
                          "delta": {"stop_reason": reason, "stop_sequence":
                                    stop_sequence if reason == "stop_sequence" else None},
                          "usage": usage},
                {"type": "message_stop"}]

    def _thinking(self, thought: str) -> list[dict]:
        if not thought:
            return []
        out = [] if self.block == "thinking" else self._start(
            {"type": "thinking", "thinking": "", "signature": ""})
        return [*out, self._delta({"type": "thinking_delta", "thinking": thought})]

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        return self._events(self.reader.feed(text) if self.reader is not None else Parsed(text))

    def _events(self, parsed: Parsed) -> list[dict]:
        out: list[dict] = []
        if parsed.content:
            if self.block != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for entry in parsed.tool_calls:
            function = entry.get("function", {})
            if "id" in entry:
                self.called = True
                out += self._start({"type": "tool_use", "id": entry["id"],
                                    "name": function["name"], "input": {}})
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": function["arguments"]}))
        return out

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        return [*out, {"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.index}]
