"""Reasoning on a real gateway over the fake engine, given DeepSeek-R1-Distill's chat template
(so `--reasoning-parser auto` picks deepseek-r1 and the prompt opens the think block, which the
fake answers with a scripted thought whose end marker comes in several tokens): the official
openai client reads reasoning_content streamed and not, both agree, the budget cuts the
thought, and the usage's reasoning tokens and DeepSeek's cache fields match the ledger."""
from __future__ import annotations

import sqlite3

import openai
import pytest

from runtime.fake_engine import THOUGHT, WORDS
from testkit.gateway_server import GatewayProcess
from tests.gateway.test_reasoning import R1_DISTILL_TEMPLATE

MESSAGES = [{"role": "system", "content": "You are a careful assistant. " * 8},
            {"role": "user", "content": "What does the fox do?"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    template = tmp / "r1.jinja"
    template.write_text(R1_DISTILL_TEMPLATE, encoding="utf-8")
    server = GatewayProcess("--fake", "--fake-step-ms", "1", "--chat-template", str(template),
                            "--prices", "deepseek-r1", "--ledger-path",
                            str(tmp / "ledger.sqlite3"))
    server.ledger = str(tmp / "ledger.sqlite3")
    yield server
    server.stop()


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def ledger_row(gw, request_id: str) -> tuple[int, int, int]:
    db = sqlite3.connect(f"file:{gw.ledger}?mode=ro", uri=True)
    try:
        return db.execute("SELECT cache_hit_tokens, cache_miss_tokens, output_tokens FROM "
                          "requests WHERE id = ?", (request_id,)).fetchone()
    finally:
        db.close()


def test_streamed_and_whole_answers_agree_and_the_sdk_reads_them(gw, client):
    whole = client.chat.completions.create(model="fake-smollm2", max_tokens=24,
                                           messages=MESSAGES)
    message = whole.choices[0].message
    assert message.reasoning_content == THOUGHT  # DeepSeek's name, an extra field
    assert message.model_extra["reasoning"] == THOUGHT  # vLLM's
    assert message.content.startswith(WORDS.strip()[:40])
    usage = whole.usage
    thought_tokens = usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought_tokens < usage.completion_tokens == 24
    stream = client.chat.completions.create(
        model="fake-smollm2", max_tokens=24, messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    final = chunks[-1].usage
    assert final.completion_tokens_details.reasoning_tokens == thought_tokens
    # DeepSeek's usage names beside OpenAI's, equal to what the ledger billed
    for answer, used in ((whole.id, usage), (chunks[0].id, final)):
        extra = used.model_extra
        hit, miss, output = ledger_row(gw, answer)
        assert (extra["prompt_cache_hit_tokens"], extra["prompt_cache_miss_tokens"]) == \
            (hit, miss) == (used.prompt_tokens_details.cached_tokens,
                            used.prompt_tokens - used.prompt_tokens_details.cached_tokens)
        assert output == used.completion_tokens
    assert final.model_extra["prompt_cache_hit_tokens"] > 0  # the second one hit the cache


def test_the_budget_cuts_the_thought(client):
    r = client.chat.completions.create(model="fake-smollm2", max_tokens=20, messages=MESSAGES,
                                       extra_body={"max_reasoning_tokens": 2})
    message = r.choices[0].message
    assert THOUGHT.startswith(message.reasoning_content) and \
        len(message.reasoning_content) < len(THOUGHT)
    assert message.content.startswith("The quick")
    none = client.chat.completions.create(model="fake-smollm2", max_tokens=8,
                                          messages=MESSAGES, reasoning_effort="none")
    assert none.choices[0].message.reasoning_content is None
    assert none.choices[0].message.content.startswith("The quick")


def test_cut_by_max_tokens_inside_the_thought_is_all_reasoning(client):
    r = client.chat.completions.create(model="fake-smollm2", max_tokens=3, messages=MESSAGES)
    message = r.choices[0].message
    assert THOUGHT.startswith(message.reasoning_content) and message.content == ""
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens_details.reasoning_tokens == 3


def test_bad_budget_is_an_openai_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-smollm2", messages=MESSAGES,
                                       extra_body={"max_reasoning_tokens": -3})
    assert info.value.body["param"] == "max_reasoning_tokens"


def test_responses_api_gives_a_reasoning_item_streamed_and_not(client):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    whole = client.responses.create(model="fake-smollm2", input="What does the fox do?",
                                    max_output_tokens=20, reasoning={"effort": "high"})
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.content[0].text == THOUGHT
    assert message.type == "message" and whole.output_text.startswith("The quick")
    tokens = whole.usage.output_tokens_details.reasoning_tokens
    assert 0 < tokens < whole.usage.output_tokens
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e.model_dump())
              for e in client.responses.create(model="fake-smollm2", max_output_tokens=20,
                                               input="What does the fox do?", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_structured_output_holds_the_answer_after_the_thought(client):
    body = {"structured_outputs": {"choice": ["Paris", "Rome"]}}
    whole = client.chat.completions.create(model="fake-smollm2", max_tokens=40,
                                           messages=MESSAGES, extra_body=body)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, "Paris")
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="fake-smollm2", max_tokens=40,
                                            messages=MESSAGES, extra_body=body, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                   for c in chunks) == THOUGHT
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Paris"
