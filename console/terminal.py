"""The terminal the console draws on.

Textual's driver draws on stderr (file descriptor 2), as every Textual app does, leaving stdout
free for an app's output. So `python -m console 2>console.log` used to send the whole screen
into the log and show nothing. Here stderr is pointed at a terminal for as long as the app
runs: stderr itself when it is one, else stdout's terminal, else the process's controlling
terminal (/dev/tty); with none of them the console stops with one line. After the run, stderr
is the caller's again (a traceback or a message after it goes where they sent it).
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

STDOUT, STDERR = 1, 2
CONTROLLING_TERMINAL = "/dev/tty"


class NoTerminal(RuntimeError):
    """Neither stderr, stdout nor a controlling terminal is a terminal to draw on."""


def drawing_target(isatty: Callable[[int], bool] = os.isatty) -> int | str:
    """What to draw on: STDERR as it is, STDOUT's terminal, or the controlling terminal."""
    if isatty(STDERR):
        return STDERR
    if isatty(STDOUT):
        return STDOUT
    return CONTROLLING_TERMINAL


@contextlib.contextmanager
def on_a_terminal() -> Iterator[None]:
    """Runs the block with file descriptor 2 on a terminal (see the module docstring)."""
    target = drawing_target()
    if target == STDERR:
        yield
        return
    if isinstance(target, int):
        fd, opened = target, False
    else:
        try:
            fd, opened = os.open(target, os.O_WRONLY | os.O_NOCTTY), True
        except OSError:
            raise NoTerminal("the console draws on a terminal, and neither stderr, stdout nor "
                             f"{CONTROLLING_TERMINAL} is one: run it in a terminal") from None
    sys.stderr.flush()
    saved = os.dup(STDERR)
    os.dup2(fd, STDERR)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, STDERR)
        os.close(saved)
        if opened:
            os.close(fd)
