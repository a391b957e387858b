"""Reasoning apart from the answer (gateway/openai/reasoning.py): the splitter fed in any
pieces gives exactly the whole answer's split (property-based, markers cut at every possible
boundary); the chunks a stream sends rebuild the non-streamed message, which the openai SDK
reads; the request fields, the usage fields and the parser picked from a template."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from contract.tokenizer import Tokenizer
from gateway.errors import APIError
from gateway.openai.reasoning import (
    parser_for_template,
    prompt_opens_think,
    reasoning_split_for,
    resolve_parser,
    split_piece,
)
from gateway.openai.requests import parse_chat_request, parse_completion_request
from gateway.openai.responses import ChoiceResult, chat_response, usage_dict
from gateway.openai.stream_chunker import StreamChunker
from gateway.serving.service import ChoiceDelta

SPLITTERS = [("deepseek-r1", False), ("deepseek-r1", True), ("qwen3", False), ("qwen3", True)]

# DeepSeek-R1-Distill-Qwen's chat template (tokenizer_config.json, the revision whose generation
# prompt opens the think block), written from its published text
R1_DISTILL_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}"
    "{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}"
    "{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
    "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + "
    "message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
QWEN3_TEMPLATE_TAIL = (  # the part of Qwen3's template that matters here
    "{%- for message in messages %}{{'<|im_start|>' + message.role + '\\n' + message.content "
    "+ '<|im_end|>\\n'}}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is "
    "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def whole(parser: str, opens: bool, text: str) -> tuple[str, str]:
    split = reasoning_split_for(parser, opens)
    assert split is not None
    r, c = split.feed(text)
    r2, c2 = split.finish()
    return r + r2, c + c2


def fed(parser: str, opens: bool, pieces: list[str]) -> tuple[str, str]:
    split = reasoning_split_for(parser, opens)
    assert split is not None
    reasoning, content = "", ""
    for piece in pieces:
        r, c = split.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    return reasoning + r, content + c


# the split, decided

@pytest.mark.parametrize("parser,opens,text,expected", [
    # R1: the prompt opened the block; the model writes its thought and closes it
    ("deepseek-r1", True, "\nI think.\n</think>\n\nParis.", ("I think.", "Paris.")),
    # R1 writing <think> itself (an older template), and with white space first
    ("deepseek-r1", False, " <think>\nHm.</think>Paris", ("Hm.", "Paris")),
    # no end marker before the end (cut by max_tokens): all reasoning, no content
    ("deepseek-r1", True, "Still thinking about", ("Still thinking about", "")),
    ("deepseek-r1", False, "No markers at all", ("No markers at all", "")),
    # a partial end marker at the end stays reasoning as written
    ("deepseek-r1", True, "Hm </thi", ("Hm </thi", "")),
    # Qwen3 thinking, and Qwen3 with thinking off (no block: all content, exactly)
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    ("qwen3", False, "  It is 4.\n", ("", "  It is 4.\n")),
    ("qwen3", False, "<thin", ("", "<thin")),
    ("qwen3", True, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    # markers after the reasoning, or a start marker that is not first, are content
    ("qwen3", False, "a <think>b</think>", ("", "a <think>b</think>")),
    ("deepseek-r1", True, "x</think>y</think><think>z", ("x", "y</think><think>z")),
    # an empty thought, an answer of white space
    ("qwen3", False, "<think>\n\n</think>\n\n", ("", "")),
    ("deepseek-r1", True, "</think>Hi", ("", "Hi")),
])
def test_the_split(parser, opens, text, expected):
    assert whole(parser, opens, text) == expected
    assert fed(parser, opens, list(text)) == expected  # one character at a time


def test_no_parser_means_no_splitter():
    assert reasoning_split_for(None) is None and reasoning_split_for("none", True) is None
    with pytest.raises(ValueError):
        reasoning_split_for("granite")


# any text, any pieces: the same split as one whole feed

FRAGMENTS = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<",
                             " ", "\n", "\n\n", "a", "Paris", "é", "<tool_call>", "x y"])
TEXTS = st.lists(FRAGMENTS | st.text(max_size=4), max_size=14).map("".join)
CUTS = st.lists(st.integers(0, 10**4), max_size=10)


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=400, deadline=None)
@given(TEXTS, CUTS, st.sampled_from(SPLITTERS))
def test_any_pieces_split_as_the_whole(text, cuts, splitter):
    parser, opens = splitter
    assert fed(parser, opens, cut(text, cuts)) == whole(parser, opens, text)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=12), st.text(max_size=12), st.sampled_from(["", "\n", " \n "]))
def test_markers_cut_at_every_boundary(thought, answer, gap):
    text = f"<think>{gap}{thought}{gap}</think>{gap}{answer}"
    expected = whole("qwen3", False, text)
    for a in range(len(text) + 1):  # every two-piece cut, and every three-piece one
        assert fed("qwen3", False, [text[:a], text[a:]]) == expected
        for b in range(a, len(text) + 1, 3):
            assert fed("qwen3", False, [text[:a], text[a:b], text[b:]]) == expected
    if "<" not in thought + answer:  # the markers are where they seem
        assert expected == (thought.strip(), answer.lstrip())


# the template's parser, and its prompt

def test_the_parser_comes_from_the_template():
    assert parser_for_template(R1_DISTILL_TEMPLATE) == "deepseek-r1"
    assert parser_for_template(QWEN3_TEMPLATE_TAIL) == "qwen3"
    assert parser_for_template("{{ messages }}") == "none" and parser_for_template(None) == "none"
    assert resolve_parser("auto", R1_DISTILL_TEMPLATE) == "deepseek-r1"
    assert resolve_parser("none", R1_DISTILL_TEMPLATE) == "none"
    assert resolve_parser("qwen3", None) == "qwen3"


def test_the_r1_distill_template_renders_and_opens_the_block(tiny_tokenizer):
    tok = tiny_tokenizer.with_chat_template(R1_DISTILL_TEMPLATE)
    prompt = tok.apply_chat_template([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"}])
    assert prompt.endswith("<｜User｜>And 3+3?<｜Assistant｜><think>\n")
    assert "add" not in prompt  # earlier turns' reasoning is dropped by the template
    assert "<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>" in prompt and prompt.startswith(
        tok.backend.id_to_token(tok.bos_token_id) + "Be brief." if tok.bos_token_id is not None
        else "Be brief.")
    assert prompt_opens_think(prompt)
    assert not prompt_opens_think(tok.apply_chat_template([{"role": "user", "content": "x"}],
                                                          add_generation_prompt=False))


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    from runtime.loading.gguf import read_gguf_tokenizer
    from runtime.loading.loader import default_model_path
    return read_gguf_tokenizer(default_model_path())


# streams and whole answers

def deltas(text_pieces: list[str], reason: str = "stop", index: int = 0) -> list[ChoiceDelta]:
    out = [ChoiceDelta(index, piece, [7], None, None) for piece in text_pieces]
    out[-1].finish_reason = reason
    return out


def streamed(pieces: list[str], parser="deepseek-r1", opens=True, tools=None):
    chunker = StreamChunker("chat", "c", "m", 1, include_usage=True, tools=tools,
                            reasoning=parser, prompt_opens_think=opens)
    chunks: list[Any] = [chunk for d in deltas(pieces) for chunk in chunker.chunks(d)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)  # the SDK's own type takes every one
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    assert reasoning == "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return reasoning, content, chunks, chunker.reasoning_tokens


ANSWER = ["\nI", " think", " it is", " 4.\n</", "thin", "k>", "\n\n", "It is", " 4."]


def test_a_stream_rebuilds_the_whole_answer_the_sdk_reads():
    reasoning, content, chunks, counted = streamed(ANSWER)
    assert (reasoning, content) == ("I think it is 4.", "It is 4.")
    # the tokens of every delta up to the one that closed the block are reasoning
    assert counted == 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    split = reasoning_split_for("deepseek-r1", True)
    pieces = [split_piece(split, d.text, d.finish_reason is not None) for d in deltas(ANSWER)]
    assert "".join(p[0] for p in pieces) == reasoning and "".join(p[1] for p in pieces) == content
    assert sum(p[2] for p in pieces) == counted
    usage = usage_dict(10, 4, 9, reasoning_tokens=counted)
    body = chat_response("c", "m", 1, [ChoiceResult(0, content, "stop", reasoning=reasoning,
                                                    has_reasoning=True)], usage)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content == "It is 4."
    assert message.reasoning_content == "I think it is 4."  # an extra field the SDK keeps
    assert body["choices"][0]["message"]["reasoning"] == "I think it is 4."
    parsed_usage = ChatCompletion.model_validate(body).usage
    assert parsed_usage.completion_tokens_details.reasoning_tokens == 6


def test_without_a_parser_nothing_changes():
    reasoning, content, _, counted = streamed(["<think>a</think>", "b"], parser=None)
    assert (reasoning, content, counted) == ("", "<think>a</think>b", 0)
    body = chat_response("c", "m", 1, [ChoiceResult(0, "x", "stop")], usage_dict(1, 0, 1))
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_tool_calls_are_read_from_the_content_only():
    tools = parse_chat_request({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object"}}}]}).tools
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    reasoning, content, chunks, _ = streamed(
        [f"I could write {call[:20]}", f"{call[20:]} here", "</think>", call[:9], call[9:]],
        tools=tools)
    assert reasoning == f"I could write {call} here"  # a call inside the thought is thought
    calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert calls and calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert content == "" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# the request fields

def test_reasoning_effort_and_budget_reach_the_sampling_params():
    def budget(**fields):
        req = parse_chat_request({"messages": [{"role": "user", "content": "x"}], **fields})
        return req.sampling_params(8).reasoning_budget
    assert budget() is None
    assert (budget(reasoning_effort="low"), budget(reasoning_effort="medium"),
            budget(reasoning_effort="high"), budget(reasoning_effort="none")) == \
        (1024, 4096, 16384, 0)
    assert budget(reasoning_effort="max") is None
    assert budget(reasoning_effort="high", max_reasoning_tokens=7) == 7
    assert budget(max_reasoning_tokens=0) == 0


@pytest.mark.parametrize("fields,param", [
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": 1.5}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": "5"}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": True}, "max_reasoning_tokens"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
])
def test_bad_reasoning_fields_are_400_naming_the_param(fields, param):
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], **fields})
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_completions_leave_reasoning_alone():
    req = parse_completion_request({"prompt": "x", "max_reasoning_tokens": 3})  # ignored
    assert req.sampling_params(4).reasoning_budget is None


# DeepSeek's usage names

def test_usage_has_deepseeks_cache_fields_beside_openais():
    usage = usage_dict(100, 64, 10)
    assert (usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]) == (64, 36)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 64
    assert "completion_tokens_details" not in usage
    assert usage_dict(5, 0, 3, reasoning_tokens=9)["completion_tokens_details"] == {
        "reasoning_tokens": 3}  # never more than the output
