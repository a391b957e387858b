"""The tool-call readers of each model family (gateway/openai/tool_parsers/): recorded outputs
of each syntax read into the same OpenAI tool calls, however the text is split (at every
boundary, one character at a time, and at random cuts), and the family picked from each
family's chat template."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.json_calls import Parsed
from gateway.openai.requests import parse_chat_request
from gateway.openai.tool_parsers import (
    READERS,
    TOOL_CALL_PARSERS,
    parser_for_template,
    reader_class,
    resolve,
)
from gateway.openai.tool_parsers.mistral import MistralCalls
from gateway.openai.tool_stream import collect, merge_calls, reader_for

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string"}, "dst": {"type": "boolean"},
                                         "offset": {"type": "number"}}}


def spec(parallel=True):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
             {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
    return parse_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                               "parallel_tool_calls": parallel}).tools


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def read(parser: str, pieces, parallel=True) -> tuple[str | None, list[dict]]:
    reader = READERS[parser](spec(parallel), ids())
    out = Parsed()
    for piece in pieces:
        out.extend(reader.feed(piece))
    out.extend(reader.finish())
    return out.content or None, merge_calls(out.tool_calls)


def simple(answer) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = answer
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"zone": "CET"})
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"zone": "CET"}}'
UNKNOWN = '{"name": "get_news", "arguments": {"city": "Paris"}}'
BAD_ARGS = '{"name": "get_weather", "arguments": {"city": 5}}'

# (text the model wrote, content, calls); None content: as written
CASES = {
    "hermes": [
        (f"<tool_call>\n{W}\n</tool_call>", None, [PARIS]),
        (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None, [PARIS, CET]),
        (f"Let me check.\n<tool_call>\n{W}\n</tool_call>\nOne moment.",
         "Let me check.One moment.", [PARIS]),
        (f"<tool_call>\n{W}\n", None, [PARIS]),  # cut short of its end marker
        ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', "=", []),
        (f"<tool_call>{UNKNOWN}</tool_call>", "=", []),
        (f"<tool_call>{BAD_ARGS}</tool_call>", "=", []),
        ("No call here, a <tool_ca", "=", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [PARIS]),
        (f' \n{W}; {T}', None, [PARIS, CET]),
        (f'{W};{T};', None, [PARIS, CET]),
        (f'Let me look.<|python_tag|>{W}', "Let me look.", [PARIS]),
        (f'{W}\n\nThat is all.', "That is all.", [PARIS]),
        (f'The call would be {W}', "=", []),  # JSON inside prose is not a call
        ('{"name": "get_weather", "parameters": {"city": "Paris"}', "=", []),  # never closed
        ('{"name": "get_weather", "parameters": {"city": "Paris"}} {"a": }', '{"a": }',
         [PARIS]),  # text after the calls is content
        (UNKNOWN, "=", []),
        (f"{W}; {BAD_ARGS}", "=", []),  # one bad call: the whole region is text
        ('{"answer": 42}', "=", []),
        ("Plain text { not json", "=", []),
    ],
    "mistral": [
        (f"[TOOL_CALLS][{W}]", None, [PARIS]),
        (f"[TOOL_CALLS] [{W}, {T}]", None, [PARIS, CET]),
        (f"[TOOL_CALLS]{W}", None, [PARIS]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [PARIS]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
         '{"zone": "CET"}', None, [PARIS, CET]),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', None, [PARIS]),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', None, [PARIS]),  # [ARGS] skipped
        (f"Sure, checking.[TOOL_CALLS][{W}]", "Sure, checking.", [PARIS]),
        (f"[TOOL_CALLS][{W}]\nDone.", "Done.", [PARIS]),
        (f"[TOOL_CALLS][{W}", "=", []),  # never closed
        ("[TOOL_CALLS]get weather now", "=", []),
        ('[TOOL_CALLS]get_weather[ARG]{"city": "Paris"}', "=", []),
        (f"[TOOL_CALLS][{UNKNOWN}]", "=", []),
        (f"[TOOL_CALLS][{W}, {BAD_ARGS}]", "=", []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": 5}', "=", []),
        ("A [TOOL_CALL in text [TOOL", "=", []),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, [PARIS]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
         '<｜tool▁sep｜>get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", None, [PARIS, CET]),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
         '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [PARIS, CET]),  # V3.1
        ('I will look it up.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather'
         '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>\nDone.',
         "I will look it up.Done.", [PARIS]),
        ('<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>',
         None, [PARIS]),  # no calls markers around it
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
         "<｜tool▁call▁end｜>", None, [PARIS]),  # the answer ended before the calls' end
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather {"city": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "=", []),  # no separator
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "=", []),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_news<｜tool▁sep｜>{"city": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "=", []),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"town": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "=", []),
        ("Text with <｜tool▁call", "=", []),
    ],
    "gemma3": [
        ('[get_weather(city="Paris")]', None, [PARIS]),
        ("[get_weather(city='Paris'), get_time(zone=\"CET\", dst=true, offset=-1.5)]", None,
         [PARIS, ("get_time", {"zone": "CET", "dst": True, "offset": -1.5})]),
        ('I will check.\n```tool_code\nget_weather(city="Paris")\n```\nOne moment.',
         "I will check.One moment.", [PARIS]),
        ('```tool_code\nget_weather(city="Paris")\nget_time(zone="CET")\n```', None,
         [PARIS, CET]),
        (f"```tool_code\n{W}\n```", None, [PARIS]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('[get_weather(city="Paris")', "=", []),  # never closed
        ("[get_weather(city=paris)]", "=", []),  # a variable, not a literal
        ('[get_weather("Paris")]', "=", []),  # positional
        ('[os.system(cmd="ls")]', "=", []),
        ('[get_news(city="Paris")]', "=", []),
        ("[get_weather(city=5)]", "=", []),
        ("[1] A numbered note, [2] another.", "=", []),
        ("Some code:\n```python\nprint('hi')\n```", "=", []),
        ("See the list below: [get_weather(city='Paris')]", "=", []),  # not the answer itself
        ("[Note: it's long] and more", "=", []),
        ("{not json}", "=", []),
    ],
}
# every family reads the fallback's blocks too (a template without tool syntax asks for them)
for _cases in list(CASES.values())[1:]:
    _cases += [(f"Checking.\n<tool_call>\n{W}\n</tool_call>", "Checking.", [PARIS]),
               (f"<tool_call>{UNKNOWN}</tool_call>", "=", [])]
ALL_CASES = [(parser, *case) for parser, cases in CASES.items() for case in cases]


def expected(text, content, calls):
    return (text if content == "=" else content), calls


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_recorded_outputs_read_into_openai_calls(parser, text, content, calls):
    whole = read(parser, [text])
    assert simple(whole) == expected(text, content, calls)
    assert [c["id"] for c in whole[1]] == [f"call_{i}" for i in range(len(calls))]
    assert all(c["type"] == "function" for c in whole[1])


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_every_split_reads_the_same(parser, text, content, calls):
    whole = read(parser, [text])
    assert read(parser, list(text)) == whole  # a boundary at every character
    for cut in range(1, len(text)):
        assert read(parser, [text[:cut], text[cut:]]) == whole, cut


CUTS = st.lists(st.integers(0, 10**4), max_size=10)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ALL_CASES), CUTS)
def test_random_splits_read_the_same(case, cuts):
    parser, text = case[0], case[1]
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    assert read(parser, [text[a:b] for a, b in zip(points, points[1:])]) == \
        read(parser, [text])


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(READERS)),
       st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "'",
                                 ";", "\n", " ", "x", "get_weather", '"name"', "(", ")",
                                 "[TOOL_CALLS]", "[ARGS]", "```tool_code", "```",
                                 "<|python_tag|>", "<｜tool▁calls▁begin｜>",
                                 "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                                 "<｜tool▁calls▁end｜>", 'city="Paris"', W]), max_size=14),
       CUTS)
def test_any_text_reads_the_same_however_split(parser, words, cuts):
    text = "".join(words)
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    whole = read(parser, [text])
    assert read(parser, [text[a:b] for a, b in zip(points, points[1:])]) == whole
    content, calls = whole
    if not calls:
        assert content == (text or None)  # no call: the text exactly as written


@pytest.mark.parametrize("parser,start", [("gemma3", "[Note: it's a long note"),
                                          ("gemma3", "[1, 2"), ("llama3_json", "{ x: y")])
def test_an_answer_that_only_begins_like_a_call_streams_on(parser, start):
    reader = READERS[parser](spec(), ids())
    assert reader.feed(start).content == start.rstrip()  # not held until the answer ends


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_the_sdk_rebuilds_each_familys_answer_from_the_stream(parser, text, content, calls):
    from tests.gateway.test_tool_stream import stream_and_whole
    streamed, whole = stream_and_whole(spec(), text, [5, 11, 12, 40, 41, 77], "stop", parser)
    assert (streamed.finish_reason, whole.finish_reason) == \
        (("tool_calls",) * 2 if calls else ("stop",) * 2)
    assert streamed.message.content == whole.message.content == \
        expected(text, content, calls)[0]
    got = [(c.type, c.function.name, c.function.arguments)
           for c in streamed.message.tool_calls or []]
    assert got == [(c.type, c.function.name, c.function.arguments)
                   for c in whole.message.tool_calls or []]
    assert [(name, json.loads(arguments)) for _, name, arguments in got] == calls


def test_the_chosen_parser_is_resolved_once_the_model_is_known():
    from types import SimpleNamespace

    from gateway.state import GatewayState
    state = SimpleNamespace(_tool_call_parser=None, service=None,
                            config=SimpleNamespace(tool_call_parser="auto"))
    assert GatewayState.tool_call_parser(state) == "hermes"  # no template yet: not kept
    assert state._tool_call_parser is None
    state.service = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=MISTRAL))
    assert GatewayState.tool_call_parser(state) == "mistral"
    state.service = None  # kept: a later worker serves the same model
    assert GatewayState.tool_call_parser(state) == "mistral"
    state = SimpleNamespace(_tool_call_parser=None, service=state.service,
                            config=SimpleNamespace(tool_call_parser="gemma3"))
    assert GatewayState.tool_call_parser(state) == "gemma3"


def test_parallel_tool_calls_false_allows_one_call():
    assert simple(read("mistral", [f"[TOOL_CALLS][{W}, {T}]"], parallel=False)) == \
        (f"[TOOL_CALLS][{W}, {T}]", [])
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert simple(read("mistral", [text], parallel=False)) == \
        ("[TOOL_CALLS]get_time[ARGS]{}", [PARIS])


def test_mistral_call_ids_are_what_its_templates_accept():
    reader = reader_for(spec(), parser="mistral")
    assert isinstance(reader, MistralCalls)
    _, calls = collect(reader, f"[TOOL_CALLS][{W}, {T}]")
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    hermes = reader_for(spec(), parser="hermes")
    assert collect(hermes, f"<tool_call>{W}</tool_call>")[1][0]["id"].startswith("call_")


def test_the_registry():
    assert TOOL_CALL_PARSERS == ("auto", "hermes", "llama3_json", "mistral", "deepseek_v3",
                                 "gemma3")
    assert reader_class("auto") is READERS["hermes"]
    for name in READERS:
        assert isinstance(reader_for(spec(), parser=name), READERS[name])
    assert resolve("mistral", None) == "mistral" and resolve("auto", None) == "hermes"


# the family picked from each family's chat template (representative snippets of each)

QWEN25 = """{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.
<tools>{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools>

For each function call, return a json object with function name and arguments within
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{%- endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>{%- endfor %}"""

LLAMA31 = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name
and its value}. Do not use variables.' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
{%- if 'tool_calls' in message %}
{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}
{{- '{"name": "' + message.tool_calls[0].function.name + '", "parameters": ' }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']
  + '<|eot_id|>' }}
{%- endfor %}"""

LLAMA32 = """{%- if tools is not none %}{{- "Given the following functions, please respond with
a JSON for a function call with its proper arguments that best answers the given prompt." }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and
its value}.' }}{%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}{%- endif %}
{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] +
'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}"""

MISTRAL = """{%- for message in messages %}
{%- if message["role"] == "user" %}
{%- if tools is not none and (message == user_messages[-1]) %}
{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- "[/AVAILABLE_TOOLS]" }}
{%- endif %}
{{- "[INST] " + message["content"] + "[/INST]" }}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}
{{- tool_call.function | tojson }}{%- endfor %}{{- "]" + eos_token }}
{%- endif %}{%- endfor %}"""

DEEPSEEK_V3 = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt =
false %}{% endif %}{%- for message in messages %}{%- if message['role'] == 'assistant' and
message['tool_calls'] %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
message['tool_calls'][0]['type'] + '<｜tool▁sep｜>' + message['tool_calls'][0]['function']
['name'] + '\\n' + '```json' + '\\n' + message['tool_calls'][0]['function']['arguments'] +
'\\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
{%- else %}{{'<｜User｜>' + message['content']}}{%- endif %}{%- endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}"""

DEEPSEEK_V31 = """{% if tools is defined and tools is not none %}{% set tool_ns.system_prompt =
tool_ns.system_prompt + '\\n\\n## Tools\\n' %}{% endif %}{%- for message in messages %}
{%- if message['role'] == 'assistant' and message['tool_calls'] %}
{{'<｜tool▁calls▁begin｜>'}}{%- for tool in message['tool_calls'] %}
{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' +
tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{%- endfor %}
{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}"""

GEMMA3_PYTHONIC = """{{ bos_token }}{%- if not tools is defined %}{%- set tools = none %}
{%- endif %}{%- for message in messages -%}{{ '<start_of_turn>' + message['role'] + '\\n' -}}
{%- if loop.first and tools is not none -%}{{- "Tools (functions) are available. If you decide
to invoke one or more of the tools, you must respond with a python list of the function calls.
Example Format: [func_name1(params_name1=params_value1), func_name2(params)]\\n" -}}
{{- tools | tojson(indent=4) -}}{%- endif -%}{{ message['content'] | trim }}<end_of_turn>
{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"""

SMOLLM2 = """{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' +
message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.mark.parametrize("template,family", [
    (QWEN25, "hermes"),
    (LLAMA31, "llama3_json"),
    (LLAMA32, "llama3_json"),
    (MISTRAL, "mistral"),
    (DEEPSEEK_V3, "deepseek_v3"),
    (DEEPSEEK_V31, "deepseek_v3"),
    (GEMMA3_PYTHONIC, "gemma3"),
    (SMOLLM2, "hermes"),  # no tool syntax: the fallback asks for <tool_call> blocks
    (None, "hermes"),
    ("{{ not a template", "hermes"),
])
def test_the_family_is_picked_from_the_chat_template(template, family):
    assert parser_for_template(template) == family
    assert resolve("auto", template) == family


def test_templates_without_tool_syntax_still_name_their_family():
    """Gemma 3's and DeepSeek-V3's own templates show no tools (the fallback does, asking for
    <tool_call> blocks, which their readers read too); their markers still pick the family."""
    from contract.model_families import GEMMA_CHAT_TEMPLATE
    assert parser_for_template(GEMMA_CHAT_TEMPLATE) == "gemma3"
    assert parser_for_template(DEEPSEEK_V3_OFFICIAL) == "deepseek_v3"


DEEPSEEK_V3_OFFICIAL = """{% set ns = namespace(is_first=false, is_tool=false) %}{%- for message in
messages %}{%- if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}{%- endif %}
{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- for tool in
message['tool_calls'] %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' +
tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endfor %}
{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}"""


# through the gateway: --tool-call-parser mistral, the real HTTP path, the official client

MISTRAL_ANSWER = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
                  '{"zone": "CET"}')


def test_the_gateway_reads_the_chosen_family_both_ways(tmp_path):
    """An in-process gateway over the fake engine, its output's text swapped for a Mistral
    answer (the fake engine writes a fixed sentence; its tokens, timing and finish stay)."""
    import asyncio
    import dataclasses

    import openai
    from aiohttp.test_utils import TestClient, TestServer
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.state import STATE

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
             {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
    body = {"model": "fake-smollm2", "messages": [{"role": "user", "content": "Weather?"}],
            "tools": tools, "max_tokens": 12, "stop": ["lazy"]}  # the fake ends by "stop"

    def scripted(real):
        def stream(gen):
            async def deltas():
                pieces = [MISTRAL_ANSWER[i:i + 7] for i in range(0, len(MISTRAL_ANSWER), 7)]
                async for delta in real(gen):
                    last = delta.finish_reason is not None
                    text = "".join(pieces) if last else (pieces.pop(0) if pieces else "")
                    yield dataclasses.replace(delta, text=text)
            return deltas()
        return stream

    async def main():
        config = GatewayConfig(fake=True, fake_step_ms=1, tool_call_parser="mistral",
                               ledger_path=str(tmp_path / "ledger.sqlite3"))
        app = create_app(config)
        async with TestClient(TestServer(app)) as client:
            for _ in range(600):
                if (await client.get("/ready")).status == 200:
                    break
                await asyncio.sleep(0.05)
            state = app[STATE]
            assert state.tool_call_parser() == "mistral"
            state.service.stream = scripted(state.service.stream)
            sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                                     max_retries=0)
            whole = await sdk.chat.completions.create(**body)
            acc = ChatCompletionStreamState()
            async for chunk in await sdk.chat.completions.create(**body, stream=True):
                acc.handle_chunk(chunk)
            await sdk.close()
            return whole.choices[0], acc.current_completion_snapshot.choices[0]

    whole, streamed = asyncio.run(main())
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls] == [PARIS, CET]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]


def test_the_flag():
    from gateway.config import load_config
    assert load_config(["--fake"], environ={}).tool_call_parser == "auto"
    assert load_config(["--fake", "--tool-call-parser", "mistral"],
                       environ={}).tool_call_parser == "mistral"
    assert load_config(["--fake"], environ={"INFERSTACK_TOOL_CALL_PARSER": "gemma3"}
                       ).tool_call_parser == "gemma3"
    with pytest.raises(SystemExit, match="--tool-call-parser takes auto, hermes"):
        load_config(["--fake", "--tool-call-parser", "pythonic"], environ={})
