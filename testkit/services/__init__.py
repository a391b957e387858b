"""Real third-party servers that tests and benchmarks start on loopback (Prometheus, PostgreSQL,
Redis), with their installers (`python -m testkit.services.<name> install`, run by `make services`).

In testkit so that `bench/fleet.py` starts the same servers as the tests without importing them.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable


def installer_main(name: str, description: str, install: Callable[[], str],
                   find: Callable[[], str | None], argv: list[str] | None = None) -> int:
    """`python -m testkit.services.<name> install|which`: apt-get the server (as root) unless
    present, or print where it is; exit 1 with the reason when neither works."""
    parser = argparse.ArgumentParser(prog=f"python -m testkit.services.{name}",
                                     description=description)
    parser.add_argument("command", choices=["install", "which"],
                        help="install: apt-get it (root) unless present; which: print where "
                             "it is")
    args = parser.parse_args(argv)
    try:
        path = install() if args.command == "install" else find()
    except (OSError, subprocess.CalledProcessError) as e:  # not root, or apt-get failed
        print(f"{name} install failed: {e}", file=sys.stderr)
        return 1
    if path is None:
        print(f"{name} is not installed", file=sys.stderr)
        return 1
    print(path)
    return 0
