"""Parse-and-validate cost of one chat request body, in microseconds.

The gateway validates every request's decoded JSON body on its one event loop before anything
else happens, so this cost is paid once per request by the process that docs/perf.md shows
saturated at 1,024 streams. Three bodies: a small one (one message), a typical one (a system
prompt, a few turns, the usual sampling fields) and one with tools and a tool-call history.
The figure is the best of a few timeit repeats (the closest estimate on a shared machine).

    python -m bench.api_parse              # from the repo root
    python -m bench.api_parse --json FILE  # also write the figures as JSON
"""
from __future__ import annotations

import argparse
import copy
import json
import timeit
from collections.abc import Iterator
from functools import partial

from gateway.openai.requests import parse_chat_request

SMALL = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 32, "stream": True}
TYPICAL = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "system", "content": "You are a helpful assistant. " * 8},
                 {"role": "user", "content": "Tell me about Paris."},
                 {"role": "assistant", "content": "Paris is the capital of France."},
                 {"role": "user", "content": [{"type": "text", "text": "And Lyon?"},
                                              {"type": "text", "text": "Briefly."}]}],
    "max_completion_tokens": 256, "temperature": 0.7, "top_p": 0.9, "seed": 1234,
    "stop": ["\n\n", "User:"], "stream": True, "stream_options": {"include_usage": True},
    "logprobs": True, "top_logprobs": 2, "user": "tenant-42", "priority": 5}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"], "additionalProperties": False}}}
TOOLS = {
    "messages": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {
                         "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
                 {"role": "user", "content": "And in Lyon?"}],
    "tools": [WEATHER, {**WEATHER, "function": {**WEATHER["function"], "name": "get_time"}}],
    "tool_choice": "auto", "max_tokens": 64, "stream": True}
BODIES = {"small": SMALL, "typical": TYPICAL, "tools": TOOLS}


def _parse_next(copies: Iterator[dict]) -> None:
    parse_chat_request(next(copies))


def per_call_us(body: dict, number: int, repeat: int) -> float:
    """Microseconds per parse, the best of `repeat` runs of `number` parses. Each run parses
    fresh copies (as each request decodes its own body), made outside the timed loop."""
    best = float("inf")
    for _ in range(repeat):
        copies = iter([copy.deepcopy(body) for _ in range(number)])
        seconds = timeit.timeit(partial(_parse_next, copies), number=number)
        best = min(best, seconds / number)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    for body in BODIES.values():
        parse_chat_request(copy.deepcopy(body))  # warm caches (the tools' schema verdicts)
    figures = {name: round(per_call_us(body, args.number, args.repeat), 2)
               for name, body in BODIES.items()}
    print("| body | us per parse |\n|---|---|")
    for name, us in figures.items():
        print(f"| {name} | {us:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
