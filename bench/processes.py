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


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (VmRSS summed), MiB."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            pass
    return total / 1024
