"""Reading tool calls out of model text: constrained calls and tagged calls, fed in arbitrary
pieces (property-based), give exactly the whole answer's calls and content; and the chunks the
stream sends, accumulated by the openai SDK, rebuild the non-streamed answer."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.openai.json_calls import CallStream, Parsed
from gateway.openai.requests import parse_chat_request
from gateway.openai.responses import ChoiceResult, chat_response
from gateway.openai.stream_chunker import StreamChunker
from gateway.openai.tool_stream import TaggedCalls, collect, finish_reason, merge_calls, reader_for
from gateway.serving.service import ChoiceDelta

NAMES = ["get_weather", "lookup", "f-1"]
ANY_ARGS = {"type": "object"}
CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^(a+)+$"}},
        "required": ["city"], "additionalProperties": False}


def spec(choice="auto", parallel=True, parameters=ANY_ARGS):
    tools = [{"type": "function", "function": {"name": n, "parameters": parameters}}
             for n in NAMES]
    return parse_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                               "tool_choice": choice, "parallel_tool_calls": parallel}).tools


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def fed(reader, pieces) -> tuple[str | None, list[dict]]:
    """The answer a stream makes: every piece fed, then finish, merged as the SDK merges."""
    out = Parsed()
    for piece in pieces:
        out.extend(reader.feed(piece))
    out.extend(reader.finish())
    return out.content or None, merge_calls(out.tool_calls)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=10)
CALLS = st.lists(st.tuples(st.sampled_from(NAMES),
                           st.dictionaries(st.text(max_size=6), JSON, max_size=4)),
                 min_size=1, max_size=3)
LAYOUT = st.sampled_from([dict(), dict(separators=(",", ":")), dict(indent=2)])
CUTS = st.lists(st.integers(0, 10**4), max_size=12)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(CALLS, st.booleans(), st.booleans(), LAYOUT, CUTS)
def test_constrained_calls_are_the_same_however_split(calls, as_array, name_last, layout, cuts):
    objects = [{"arguments": a, "name": n} if name_last else {"name": n, "arguments": a}
               for n, a in calls]
    if not as_array:
        objects = objects[:1]
    text = json.dumps(objects if as_array else objects[0], ensure_ascii=False, **layout)
    whole = collect(CallStream(ids()), text)
    assert fed(CallStream(ids()), split(text, cuts)) == whole
    content, got = whole
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == \
        [(o["name"], compact(o["arguments"])) for o in objects]
    assert [c["id"] for c in got] == [f"call_{i}" for i in range(len(objects))]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(['{"name": "f", "argu', '[{"name": 1}]', "{}",
                                                '{"name": "f", "arguments": {}} tail']), CUTS)
def test_any_text_reads_the_same_however_split(text, cuts):
    for make in (lambda: CallStream(ids()), lambda: TaggedCalls(spec(), ids())):
        assert fed(make(), split(text, cuts)) == collect(make(), text)


def tagged_text(calls, prose, gap) -> str:
    blocks = [f"<tool_call>{gap}{json.dumps({'name': n, 'arguments': a})}{gap}</tool_call>"
              for n, a in calls]
    return prose + gap + gap.join(blocks) + gap


@settings(max_examples=300, deadline=None)
@given(CALLS, st.text(max_size=20).filter(lambda t: "<" not in t),
       st.sampled_from(["", "\n", " \n "]), CUTS)
def test_tagged_calls_are_the_same_however_split(calls, prose, gap, cuts):
    text = tagged_text(calls, prose, gap)
    whole = collect(TaggedCalls(spec(), ids()), text)
    assert fed(TaggedCalls(spec(), ids()), split(text, cuts)) == whole
    content, got = whole
    assert content == (prose.rstrip() or None)  # whitespace beside calls is not content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == \
        [(n, a) for n, a in calls]


def test_tagged_text_that_is_no_valid_call_stays_as_written():
    tools = spec(parameters=CITY)
    for text in ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "lookup", "arguments": {"town": "a"}}</tool_call>',
                 '<tool_call>{"name": "lookup", "arguments": {"city": 5}}</tool_call>',
                 '<tool_call>not json</tool_call> and more', "Hi <tool_ca", "x\n\n"]:
        assert collect(TaggedCalls(tools, ids()), text) == (text, [])


def test_tagged_calls_details():
    tools = spec(parameters=CITY)
    # regexes are not run on model text (a hostile pattern would stall the event loop)
    call = '{"name": "lookup", "arguments": {"city": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!"}}'
    content, calls = collect(TaggedCalls(tools, ids()), f"Sure.\n<tool_call>\n{call}\n")
    assert content == "Sure." and len(calls) == 1  # an unclosed last block still counts
    as_string = '{"name": "lookup", "arguments": "{\\"city\\": \\"a\\"}"}'
    assert collect(TaggedCalls(tools, ids()), f"<tool_call>{as_string}</tool_call>")[1][0][
        "function"]["arguments"] == '{"city":"a"}'
    two = f"<tool_call>{call}</tool_call><tool_call>{call}</tool_call>"
    content, calls = collect(TaggedCalls(spec("auto", parallel=False, parameters=CITY), ids()),
                             two)
    assert len(calls) == 1 and content == f"<tool_call>{call}</tool_call>"


def test_constrained_text_that_is_no_call_is_content():
    assert collect(CallStream(ids()), " The quick brown") == (" The quick brown", [])
    content, calls = collect(CallStream(ids()), '{"name": "f", "arguments": {"a": 1}} tail')
    assert content == "tail" and calls[0]["function"]["arguments"] == '{"a":1}'
    # cut by max_tokens: the call so far, its arguments unfinished
    assert collect(CallStream(ids()), '{"name": "f", "arguments": {"a": [1')[1][0][
        "function"]["arguments"] == '{"a":[1'


def test_finish_reason_and_readers():
    assert reader_for(None) is None and reader_for(spec("none")) is None
    assert isinstance(reader_for(spec("required")), CallStream)
    assert isinstance(reader_for(spec("auto")), TaggedCalls)
    reader = CallStream(ids())
    assert finish_reason("stop", reader) == "stop"
    collect(reader, '{"name": "f", "arguments": {}}')
    assert (finish_reason("stop", reader), finish_reason("length", reader)) == \
        ("tool_calls", "length")


# the chunks of a stream, accumulated by the openai SDK, against the whole answer

def stream_and_whole(tools, text: str, cuts, reason="stop", parser="auto"):
    chunker = StreamChunker("chat", "chatcmpl-1", "m", 1, tools=tools, tool_parser=parser)
    pieces = split(text, cuts)
    state = ChatCompletionStreamState()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for chunk in chunker.chunks(ChoiceDelta(0, piece, [1], None, reason if last else None)):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.current_completion_snapshot.choices[0]
    reader = reader_for(tools, parser=parser)
    content, calls = collect(reader, text)
    body = chat_response("chatcmpl-1", "m", 1, [ChoiceResult(
        0, content, finish_reason(reason, reader), tool_calls=calls)], {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    return streamed, ChatCompletion.model_validate(body).choices[0]


def same(streamed, whole) -> None:
    assert streamed.finish_reason == whole.finish_reason
    assert streamed.message.content == whole.message.content
    got = [(c.type, c.function.name, c.function.arguments) for c in streamed.message.tool_calls
           or []]
    want = [(c.type, c.function.name, c.function.arguments) for c in whole.message.tool_calls
            or []]
    assert got == want
    for call in streamed.message.tool_calls or []:
        assert call.id.startswith("call_") and len(call.id) == 29


@settings(max_examples=100, deadline=None)
@given(CALLS, LAYOUT, CUTS, st.sampled_from(["required", "auto"]))
def test_the_sdk_rebuilds_the_whole_answer_from_the_stream(calls, layout, cuts, choice):
    objects = [{"name": n, "arguments": a} for n, a in calls]
    text = json.dumps(objects, **layout) if choice == "required" else \
        tagged_text(calls, "Let me check.", "\n")
    streamed, whole = stream_and_whole(spec(choice), text, cuts)
    same(streamed, whole)
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == len(calls)
    assert whole.message.content == (None if choice == "required" else "Let me check.")


@pytest.mark.parametrize("choice,text,reason", [
    ("auto", "Just text, no call.", "stop"),
    ("required", '{"name": "lookup", "arguments": {"q": "abc', "length"),
    ("auto", '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "length"),
])
def test_the_sdk_rebuilds_answers_without_calls_or_cut_short(choice, text, reason):
    streamed, whole = stream_and_whole(spec(choice), text, [3, 17, 30], reason)
    same(streamed, whole)
    assert whole.finish_reason == reason
