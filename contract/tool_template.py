"""How tools, tool calls and tool results reach a chat template.

A template with tool syntax (it reads the Jinja variable `tools`) gets them in Hugging Face's
convention: `tools` as OpenAI function tools, assistant messages with `tool_calls` whose
arguments are objects, `tool` messages with `tool_call_id` (`for_template`).

A template without (SmolLM2's has none) gets the fallback (`fallback`), plain system, user and
assistant turns it already knows:
- the tools: a block appended to the first system message (or a new system message) listing
  each tool as one JSON line inside <tools></tools>, and the instruction to answer with
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the form the gateway reads back;
- an assistant turn's calls: one such <tool_call> block each, after its text;
- tool results: a user turn saying in plain words what each call returned ("The get_weather
  call returned: ..."), consecutive results in one turn. A user turn, because a template
  without tool syntax knows no other role for input from outside the model (an unknown role is
  rendered as a name the model never saw); plain words, not tags, because tagged results were
  imitated: SmolLM2-135M, shown a <tool_response> turn, wrote one itself on the next question
  instead of calling, and with the plain sentence it called.
"""
from __future__ import annotations

import json

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESULT = "The {name} call returned: {content}"
TOOLS_INSTRUCTIONS = """\
# Tools

You can call the functions listed below, one JSON object per line inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with this block, one for each call, and nothing else:
<tool_call>
{{"name": "<the function's name>", "arguments": {{<its arguments as a JSON object>}}}}
</tool_call>"""


def uses_tools(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as templates with tool syntax read them: call arguments decoded to objects."""
    return [{**m, "tool_calls": [_decoded(c) for c in m["tool_calls"]]} if m.get("tool_calls")
            else m for m in messages]


def _decoded(call: dict) -> dict:
    function = call["function"]
    return {**call, "function": {**function, "arguments": _arguments(function["arguments"])}}


def _arguments(text: str):
    """The arguments object; the text itself when it is not JSON (it is shown as sent)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation in plain system/user/assistant turns (the module docstring)."""
    out: list[dict] = []
    previous = None
    names: dict[str, str] = {}  # call id -> function name, from the calls made so far
    for m in messages:
        for call in m.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool":
            name = names.get(m.get("tool_call_id", ""), "tool")
            response = TOOL_RESULT.format(name=name, content=m["content"])
            if previous == "tool":  # the results of one turn's calls go together
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], _arguments(c["function"]["arguments"]))
                      for c in m["tool_calls"]]
            text = [m["content"]] if m["content"] else []
            out.append({"role": m["role"], "content": "\n".join([*text, *blocks])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous = m["role"]
    if tools:
        listing = TOOLS_INSTRUCTIONS.format(tools="\n".join(_tool_line(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def call_block(name: str, arguments) -> str:
    """One call as the fallback writes it, and as the model is asked to."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


def _tool_line(tool: dict) -> str:
    function = tool["function"]
    line = {"name": function["name"]}
    if function.get("description"):
        line["description"] = function["description"]
    line["parameters"] = function.get("parameters", {"type": "object", "properties": {}})
    return json.dumps(line, ensure_ascii=False)
