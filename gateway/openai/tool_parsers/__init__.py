"""Tool-call readers per model family, for tool_choice "auto" (gateway/openai/tool_stream.py
chooses between them and the constrained reader of "required" and named calls).

Each reader has `feed(text) -> Parsed` and `finish() -> Parsed` (the new content and the new
`delta.tool_calls` entries) and `num_calls`; all share one behaviour (tool_parsers/base.py) and
differ only in the syntax they read:

- hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen 2.5, Qwen 3,
  and every template without tool syntax: the gateway's fallback asks for this form);
- llama3_json: {"name": ..., "parameters": {...}} as the answer, after <|python_tag|> or not,
  ";" between calls (Llama 3.1, 3.2, 3.3);
- mistral: [TOOL_CALLS][{...}, ...] or [TOOL_CALLS]name[ARGS]{...};
- deepseek_v3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  (V3, R1 and V3.1's forms);
- gemma3: a Python list of calls as the answer, or a ```tool_code fence (vLLM's pythonic form
  for Gemma 3, and Google's).

Every reader also reads hermes's <tool_call> blocks: a template without tool syntax of its own
(SmolLM2's, Gemma 3's, DeepSeek-V3's and R1's official ones) gets the gateway's fallback
(contract/tool_template.py), which shows the tools and asks for those blocks.

`auto` (the default of --tool-call-parser) is the family the model's chat template names
(`parser_for_template`).
"""
from __future__ import annotations

from gateway.openai.tool_parsers.base import CallReader
from gateway.openai.tool_parsers.deepseek_v3 import DeepSeekV3Calls
from gateway.openai.tool_parsers.gemma3 import Gemma3Calls
from gateway.openai.tool_parsers.hermes import HermesCalls
from gateway.openai.tool_parsers.llama3_json import Llama3JsonCalls
from gateway.openai.tool_parsers.mistral import MistralCalls

READERS: dict[str, type[CallReader]] = {
    "hermes": HermesCalls,
    "llama3_json": Llama3JsonCalls,
    "mistral": MistralCalls,
    "deepseek_v3": DeepSeekV3Calls,
    "gemma3": Gemma3Calls,
}
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, *READERS)  # the names --tool-call-parser takes

# what a template shows of its family's tool syntax, in the order they are told apart: the
# first family whose every marker the template names (a ChatML template with <tool_call> may
# also be a Llama fine-tune's, so <tool_call> is looked for before Llama's markers)
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("deepseek_v3", ("tool▁call▁begin",)),
    ("deepseek_v3", ("tool▁calls▁begin",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ("<|start_header_id|>", "parameters")),
    ("gemma3", ("<start_of_turn>",)),
)


def reader_class(name: str) -> type[CallReader]:
    """The reader of a parser name; `auto` not yet resolved reads the fallback's form."""
    return READERS.get(name, HermesCalls)


def parser_for_template(template: str | None) -> str:
    """The family whose markers the chat template names (whether or not it shows tools: one
    that does not gets the fallback's <tool_call> blocks, which every reader reads too);
    hermes for a template that names none of them, or no template."""
    if not template:
        return "hermes"
    for name, markers in _TEMPLATE_MARKERS:
        if all(marker in template for marker in markers):
            return name
    return "hermes"


def resolve(name: str, template: str | None) -> str:
    """--tool-call-parser's value made a family: `auto` from the template."""
    return parser_for_template(template) if name == AUTO else name
