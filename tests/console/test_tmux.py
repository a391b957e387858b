"""The console in a real terminal: started under tmux at 80x24 and 200x50, its screen captured."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.console.conftest import FEED

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed: the real-terminal check needs it")


def tmux(socket: str, *args: str, check: bool = True) -> str:
    """tmux on a private server (its own socket, no config), so nothing else shapes the window."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # pytest's
    return subprocess.run(["tmux", "-L", socket, "-f", os.devnull, *args], check=check, env=env,
                          capture_output=True, text=True, timeout=10).stdout


def capture_until(socket: str, texts: list[str], timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux(socket, "capture-pane", "-p", "-t", "console")
        if all(t in screen for t in texts):
            break
        time.sleep(0.25)
    return screen


@pytest.mark.parametrize("width, height, texts", [
    (80, 24, ["fake-smollm2", "Workers", "Prefix cache", "Queue & latency", "Revenue",
              "year @128 GPUs", "Quit"]),
    (200, 50, ["fake-smollm2", "ended", "Workers", "Prefix cache", "Revenue", "Tenants",
               "Recent requests", "acme", "globex", "initech", "TTFT", "Pause", "Help"]),
], ids=["80x24", "200x50"])
def test_renders_in_a_real_terminal(width, height, texts):
    socket = f"console-test-{os.getpid()}-{width}x{height}"
    command = shlex.join([sys.executable, "-m", "console", "--replay", str(FEED),
                          "--speed", "50"])
    tmux(socket, "new-session", "-d", "-s", "console", "-x", str(width), "-y", str(height),
         "-c", str(ROOT), "-e", "TERM=xterm-256color", command)
    try:
        screen = capture_until(socket, texts)
        lines = screen.splitlines()
        assert len(lines) <= height and max(map(len, lines)) <= width
        missing = [t for t in texts if t not in screen]
        assert not missing, f"missing {missing} in:\n{screen}"
    finally:
        tmux(socket, "kill-server", check=False)
