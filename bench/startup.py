"""Start-up time of `python -m gateway --host 127.0.0.1 --port P`: process start to the first
GET /ready answered 200, cold and warm, this tree against the code before it (issue 34).

  cold   an empty INFERSTACK_CACHE_DIR for each run: no kernel-crossover table (measured at
         the start) and, for the code before, no float32 weight cache (it writes one).
  warm   a cache folder that one untimed start of the same tree filled: a restart.

Both keep the OS page cache as it is (the GGUF file, Python's packages and the compiled
kernels are in memory after the first start: dropping it needs root, and would time the disk,
which the targets do not name), and the kernels' build cache (XDG_CACHE_HOME, prebuilt in the
environment by `make kernels`). One untimed start per tree comes first, so a tree whose kernel
sources differ from the prebuilt ones compiles them outside the timings. Runs alternate
between the trees, so both see the same machine; the load average is recorded with each.

The code before: a checkout of it (`git worktree add /work/tmp/startup-before <commit>`, or
`git archive <commit> | tar -x -C DIR`) passed as `--before DIR`, run by the same interpreter
with PYTHONPATH=DIR from DIR; `--after DIR` does the same for the code after (default: this
tree), so that other work going on in this tree stays out of the timings.

    python -m bench.startup --before /work/tmp/startup-before      # 5 runs of each
    python -m bench.startup --runs 3                                 # this tree only
    python -m bench.startup --before DIR --crossovers TABLE          # both warm on one table
"""
from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import REPO_ROOT, fmt, log, markdown_table, median, write_json
from bench.gateway_servers import free_port
from bench.processes import tree_rss_mib

POLL_S = 0.02  # between two GET /ready: the resolution of the timings
# a worker's progress lines, its ready line and a kernel build (which would spoil a warm run)
STAGE = re.compile(r"(?:runtime\.startup|runtime\.transport\.worker|kernels\.cpu_build): (.*)$")


@dataclass
class Run:
    seconds: float
    load_before: float
    load_after: float
    rss_mib: float  # the gateway and its workers, at ready
    cache_mib: float  # the cache folder after the start
    stages: list[str] = field(default_factory=list)


@dataclass
class Tree:
    name: str  # "after" (this tree) or "before"
    root: Path
    warm_dir: str = ""
    runs: dict[str, list[Run]] = field(default_factory=lambda: {"cold": [], "warm": []})

    def env(self, cache_dir: str) -> dict[str, str]:
        env = {**os.environ, "INFERSTACK_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
        if self.root != REPO_ROOT:  # this tree's checkout, not the one installed in the venv
            env["PYTHONPATH"] = str(self.root)
        return env


def start_once(tree: Tree, cache_dir: str, timeout: float) -> Run:
    """One start of the gateway, timed from the process's start to /ready 200, then stopped."""
    port = free_port()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=tree.root, env=tree.env(cache_dir),
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            seconds = _until_ready(proc, port, start, timeout)
            rss = tree_rss_mib(proc.pid)
        finally:
            _stop(proc)
        stderr.seek(0)
        stages = [m.group(1) for line in stderr.read().splitlines()
                  if (m := STAGE.search(line))]
    return Run(seconds, load_before, os.getloadavg()[0], rss, _folder_mib(cache_dir), stages)


def _until_ready(proc: subprocess.Popen, port: int, start: float, timeout: float) -> float:
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ready")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return time.perf_counter() - start
        except OSError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise TimeoutError(f"not ready within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _folder_mib(folder: str) -> float:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) / 2 ** 20


def measure(trees: list[Tree], runs: int, timeout: float, crossovers: str | None) -> None:
    for tree in trees:  # untimed: kernel builds, page cache; fills the warm folder
        tree.warm_dir = tempfile.mkdtemp(prefix=f"startup-warm-{tree.name}-")
        if crossovers:
            shutil.copy(crossovers, os.path.join(tree.warm_dir, "linear-crossover.json"))
        log(f"{tree.name}: first start (untimed), filling {tree.warm_dir}")
        start_once(tree, tree.warm_dir, timeout)
    for i in range(runs):
        for mode in ("cold", "warm"):
            for tree in trees:
                cold_dir = tempfile.mkdtemp(prefix=f"startup-cold-{tree.name}-")
                try:
                    run = start_once(tree, cold_dir if mode == "cold" else tree.warm_dir,
                                     timeout)
                finally:
                    shutil.rmtree(cold_dir, ignore_errors=True)
                tree.runs[mode].append(run)
                log(f"run {i + 1}/{runs} {mode:4} {tree.name:6} {run.seconds:6.2f} s "
                    f"(load {run.load_before:.1f} -> {run.load_after:.1f}, "
                    f"RSS {run.rss_mib:.0f} MiB, cache {run.cache_mib:.0f} MiB)")
                for line in run.stages:
                    if "building" in line or mode == "warm" and "measured in" in line:
                        log(f"    not a plain {mode} start: {line}")
    for tree in trees:
        shutil.rmtree(tree.warm_dir, ignore_errors=True)


def table(trees: list[Tree]) -> str:
    before = next((t for t in trees if t.name == "before"), None)
    rows = []
    for mode in ("cold", "warm"):
        for tree in trees:
            times = [r.seconds for r in tree.runs[mode]]
            ratio = "n/a"
            if before is not None and tree is not before:
                ratio = fmt(median(times) / median([r.seconds for r in before.runs[mode]]))
            rows.append([mode, tree.name, len(times), fmt(min(times)), fmt(median(times)),
                         fmt(max(times)), ratio,
                         f"{median([r.cache_mib for r in tree.runs[mode]]):.0f}",
                         f"{median([r.rss_mib for r in tree.runs[mode]]):.0f}",
                         f"{min(r.load_before for r in tree.runs[mode]):.1f}-"
                         f"{max(r.load_after for r in tree.runs[mode]):.1f}"])
    return markdown_table(["start", "code", "runs", "min s", "median s", "max s",
                           "median / before", "cache MiB", "RSS MiB", "load"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed starts of each kind")
    parser.add_argument("--before", default=None,
                        help="a checkout of the code before, run side by side")
    parser.add_argument("--after", default=str(REPO_ROOT),
                        help="the code after (default: this tree); a frozen copy keeps other "
                             "work in the tree (a kernel edit: a rebuild) out of the timings")
    parser.add_argument("--crossovers", default=None,
                        help="a kernel-crossover table (linear-crossover.json) copied into both "
                             "trees' warm folders: a restart where the first start measured "
                             "on a quiet machine (on a busy one the code before measures "
                             "again at every start, the code after keeps its first result)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to ready, at most")
    parser.add_argument("--json", default=str(REPO_ROOT / "bench" / "results" / "startup.json"))
    args = parser.parse_args(argv)
    # a SIGTERM ends the run through the `finally` that stops the gateway being timed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    trees = [Tree("after", Path(args.after).resolve())]
    if args.before:
        trees.insert(0, Tree("before", Path(args.before).resolve()))
    measure(trees, args.runs, args.timeout, args.crossovers)
    print(table(trees))
    stages = trees[-1].runs["warm"][-1].stages
    if stages:
        print("\nThe last warm start's progress lines:\n\n" + "\n".join(f"    {s}" for s in stages))
    write_json(args.json, {"cpu_count": os.cpu_count(), "trees": {
        t.name: {"root": t.root, "runs": {mode: [asdict(r) for r in runs]
                                          for mode, runs in t.runs.items()}} for t in trees}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
