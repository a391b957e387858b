"""DeepSeek-V3, R1 (0528) and V3.1: calls between DeepSeek's own markers,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3 and R1: the call's type, the separator, the name and the arguments in a ```json fence),
or V3.1's `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`,
one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call inside the calls markers. A region opens
with <｜tool▁calls▁begin｜> (and runs to <｜tool▁calls▁end｜>) or with a lone
<｜tool▁call▁begin｜> (to its <｜tool▁call▁end｜>). Text before and after is content. The form
is told by the fence, not by the word "function" (a tool may be named so).
"""
from __future__ import annotations

from gateway.openai.tool_parsers.base import WS, Call, CallReader, Until

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3Calls(CallReader):
    OPENERS = (CALLS_BEGIN, CALL_BEGIN)

    def _scanner(self, opener: str) -> Until:
        return Until(len(opener), CALLS_END if opener == CALLS_BEGIN else CALL_END)

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        body = region.removeprefix(CALLS_BEGIN)
        if region.startswith(CALLS_BEGIN) and closed:
            body = body[:-len(CALLS_END)]
        calls = []
        while body := body.strip(WS):
            if not body.startswith(CALL_BEGIN):
                return None
            end = body.find(CALL_END)
            one, body = (body[len(CALL_BEGIN):end], body[end + len(CALL_END):]) if end >= 0 \
                else (body[len(CALL_BEGIN):], "")  # the last call, cut short of its end marker
            call = _call(one)
            if call is None:
                return None
            calls.append(call)
        return calls or None


def _call(text: str) -> Call | None:
    kind, sep, rest = text.partition(SEP)
    if not sep:
        return None
    if FENCE not in rest:  # V3.1: NAME<｜tool▁sep｜>{...}
        return kind.strip(WS), rest.strip(WS)
    name, _, fenced = rest.partition("\n")  # V3: TYPE<｜tool▁sep｜>NAME\n```json\n{...}\n```
    opening, _, arguments = fenced.strip(WS).partition("\n")
    if not opening.startswith(FENCE) or not arguments.rstrip(WS).endswith(FENCE):
        return None
    return name.strip(WS), arguments.rstrip(WS)[:-len(FENCE)].strip(WS)
