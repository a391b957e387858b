"""Start-up progress on the `runtime.startup` logger: what is loaded, then one line per stage
with its seconds (header and tokenizer, model build, kernel crossovers, KV cache), and last
"ready in N s" counted from the process's own start, imports included: what a person waiting
for the server sees. A worker's stderr goes to the gateway's log, so the lines show there.
"""
from __future__ import annotations

import logging
import os
import sys
import time

LOGGER = "runtime.startup"
log = logging.getLogger(LOGGER)
_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc), else since this
    module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def log_ready(what: str = "ready") -> None:
    log.info("%s in %.1f s (since the process started)", what, process_seconds())


def show_on_stderr() -> None:
    """Print the runtime's INFO lines (the stages above) on stderr, for a command run by hand,
    unless logging is configured already."""
    runtime = logging.getLogger("runtime")
    if logging.getLogger().handlers or runtime.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(message)s]"))
    runtime.addHandler(handler)
    runtime.setLevel(logging.INFO)
