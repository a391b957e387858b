"""A process and its descendants, read from Linux /proc: what the benchmarks sum a server's
memory and CPU time over (a gateway's workers are its children)."""
from __future__ import annotations

import os


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant (those that exit meanwhile are skipped)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in found:
            continue
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return found
