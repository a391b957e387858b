"""Every `--flag` the README names exists in the parser of the program it is named for.

Two kinds of mention, read apart:
- a command (a line of a code block, or an inline code span, running `python -m MODULE`,
  `.venv/bin/python -m MODULE` or `make TARGET`): each flag after it must be one of that
  program's (`make run` starts `python -m gateway`). Commands of other tools (curl, pip, ray,
  docker) are not ours to check.
- a flag named in prose (`--workers N`): it must be a flag of one of the programs its section
  is about (`SECTIONS`), or one of the few other tools' flags in `OTHER_TOOLS`.

The parsers are the programs' own, imported (or caught as the program builds one), so a flag
renamed or removed in code fails here until the README follows.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# a program invocation and its arguments, up to the end of the command
COMMAND = re.compile(r"(?:(?:\S*/)?python3? -m ([\w.]+)(?: (serve|generate|info|export-tokenizer)"
                     r"\b)?|\bmake ([\w-]+))([^|;#`]*)")
MAKE_TARGETS = {"run": "gateway"}  # make targets whose command line takes flags, by program

# flags of other tools the prose names, and whose they are
OTHER_TOOLS = {"--no-deps": "pip (the model package's install)",
               "--index-url": "pip (torch's CPU index)"}

# the programs each section's prose is about (a ### section inherits its ## section's)
SECTIONS = {
    "Quick start (a fresh machine)": ("gateway",),
    "The gateway": ("gateway",),
    "Workers shared by many gateways": ("gateway", "runtime serve"),
    "The operator console and the load tester": ("console", "loadtest"),
    "The runtime from the shell": ("runtime",),
    "Expert-parallel simulator": ("runtime.ep_sim",),
    "Quantized weights and CPU threads": ("gateway", "runtime serve", "runtime",
                                          "bench.decode_step"),
    "The runtime from Python": ("runtime", "gateway"),
    "Tests and benchmarks": ("bench.engine", "bench.gateway", "bench.deepseek_vs_llama",
                             "bench.batch_tier", "scripts/gpu_check.sh", "gateway",
                             "runtime serve"),
    "Dependencies and why": ("gateway",),
}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _catch(build: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser `build` makes before parsing: for programs that build it inside main()."""
    def parse(self, *args, **kwargs):
        raise _Built(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse), \
            mock.patch.object(sys, "argv", ["prog"]):
        try:
            build()
        except _Built as built:
            return built.parser
    raise AssertionError(f"{build} parsed nothing")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and of its subcommands."""
    flags = {s for s in parser._option_string_actions if s.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


def _module(name: str):
    return importlib.import_module(name)


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "gateway": lambda: _module("gateway.config").build_parser(),
    "runtime": lambda: _module("runtime.cli").build_parser(),
    "runtime serve": lambda: _catch(_module("runtime.transport.serve").parse_args),
    "runtime.transport.worker": lambda: _module("runtime.transport.worker").build_parser(),
    "loadtest": lambda: _module("loadtest.cli").build_parser(),
    "console": lambda: _catch(_module("console.__main__").parse_args),
    "billing.economics": lambda: _catch(_module("billing.economics").main),
    "runtime.spec_decode.make_draft": lambda: _catch(
        _module("runtime.spec_decode.make_draft").main),
}


@cache
def flags_of(program: str) -> frozenset[str]:
    if program in PARSERS:
        return frozenset(_flags(PARSERS[program]()))
    if program.endswith(".sh"):  # a shell script: the options its text handles
        return frozenset(FLAG.findall((ROOT / program).read_text()))
    module = _module(program)  # a benchmark: its main() builds its parser
    return frozenset(_flags(_catch(getattr(module, "parse_args", None) or module.main)))


def _sections() -> list[tuple[str, str]]:
    """(section, text) per heading; a ### section keeps its ## section's name unless mapped."""
    out, current, parent = [], "", ""
    for part in re.split(r"^(#{2,3} .+)$", README, flags=re.M):
        if part.startswith("## "):
            current = parent = part[3:].strip()
        elif part.startswith("### "):
            name = part[4:].strip()
            current = name if name in SECTIONS else parent
        else:
            out.append((current, part))
    return out


def _program(match: re.Match) -> str | None:
    module, sub, target, _ = match.groups()
    if target is not None:
        return MAKE_TARGETS.get(target)
    return f"{module} {sub}" if module == "runtime" and sub == "serve" else module


def mentions() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(program, flag, context) of each command's flags, and (section, flag, context) of each
    flag named in prose."""
    commands, prose = [], []
    for section, text in _sections():
        blocks = re.split(r"^```.*$", text, flags=re.M)
        for i, block in enumerate(blocks):
            if i % 2:  # a code block: one command per line, `\` continuing it
                units = block.replace("\\\n", " ").splitlines()
            else:  # prose: inline code spans, which may wrap across lines
                units = re.findall(r"`([^`]+)`", block.replace("\n", " "))
            for unit in units:
                rest = unit
                for m in COMMAND.finditer(unit):
                    program = _program(m)
                    if program is not None:
                        commands += [(program, f, unit) for f in FLAG.findall(m.group(4))]
                    rest = rest.replace(m.group(0), " ")
                if i % 2 == 0 and not re.match(r"\s*(curl|pip|ray|docker|export)\b", rest):
                    prose += [(section, f, unit) for f in FLAG.findall(rest)]
    return commands, prose


def test_the_readme_is_read():
    commands, prose = mentions()
    programs = {p for p, _, _ in commands}
    assert {"gateway", "runtime", "runtime serve", "loadtest", "console"} <= programs, programs
    assert len(prose) > 50


@pytest.mark.parametrize("program", sorted({p for p, _, _ in mentions()[0]}))
def test_every_flag_of_a_readme_command_exists(program: str):
    known = flags_of(program)
    missing = sorted({(f, ctx) for p, f, ctx in mentions()[0] if p == program and f not in known})
    assert not missing, f"README runs `{program}` with flags it does not have: {missing}"


def test_every_flag_named_in_prose_exists_where_it_is_named():
    missing = []
    for section, flag, context in mentions()[1]:
        assert section in SECTIONS, f"map README section {section!r} in SECTIONS"
        if flag in OTHER_TOOLS:
            continue
        if not any(flag in flags_of(p) for p in SECTIONS[section]):
            missing.append((section, flag, context))
    assert not missing, "README names flags its programs do not have:\n" + "\n".join(
        f"  [{s}] {f} in `{c}`" for s, f, c in missing)
