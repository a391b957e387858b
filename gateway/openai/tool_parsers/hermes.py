"""Hermes, Qwen 2.5, Qwen 3 (and our fallback for templates without tool syntax,
contract/tool_template.py): each call a block of its own,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

"parameters" is read as well as "arguments", and arguments written as a JSON string are
decoded (as vLLM's and SGLang's hermes/qwen25 parsers do). A block the model never closed is
read as far as it goes. Every family's reader reads these blocks too (tool_parsers/base.py);
this one reads nothing else.
"""
from __future__ import annotations

from gateway.openai.tool_parsers.base import Call, CallReader, Scanner


class HermesCalls(CallReader):
    def _scanner(self, opener: str) -> Scanner:
        raise AssertionError("hermes has no openers of its own")

    def _calls(self, region: str, closed: bool) -> list[Call] | None:
        return None
