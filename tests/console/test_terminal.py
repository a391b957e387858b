"""Where the console draws: Textual's driver writes the screen to stderr, so with stderr
redirected (`2>console.log`) the console draws on stdout's terminal instead, and with no
terminal at all it stops with one line (console/terminal.py)."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from console.terminal import CONTROLLING_TERMINAL, STDERR, STDOUT, drawing_target
from tests.console.conftest import FEED

ROOT = Path(__file__).resolve().parents[2]
ALTERNATE_SCREEN = b"\x1b[?1049h"  # what Textual writes first when it takes the terminal


@pytest.mark.parametrize("ttys, target", [
    ({STDERR, STDOUT}, STDERR), ({STDERR}, STDERR), ({STDOUT}, STDOUT),
    (set(), CONTROLLING_TERMINAL)])
def test_the_drawing_target(ttys, target):
    assert drawing_target(lambda fd: fd in ttys) == target


def _console(stdout, stderr, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "console", "--replay", str(FEED), "--speed", "50"], cwd=ROOT,
        stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        env={**os.environ, "TERM": "xterm-256color"}, **kwargs)


@pytest.mark.subprocess
def test_with_stderr_redirected_it_draws_on_stdouts_terminal(tmp_path):
    master, slave = pty.openpty()
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err:
        proc = _console(slave, err)
    os.close(slave)
    screen = b""
    try:
        deadline = time.monotonic() + 60
        while ALTERNATE_SCREEN not in screen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    screen += os.read(master, 65536)
                except OSError:  # the console exited: the pty closed
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(master)
    assert ALTERNATE_SCREEN in screen, screen[-500:]
    assert ALTERNATE_SCREEN not in log.read_bytes(), "the screen went into the stderr file"


@pytest.mark.subprocess
def test_without_any_terminal_it_stops_with_one_line(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        # a new session has no controlling terminal: /dev/tty cannot be opened either
        proc = _console(o, e, start_new_session=True)
    assert proc.wait(60) == 2
    lines = err.read_text().splitlines()
    assert len(lines) == 1 and "run it in a terminal" in lines[0], lines
