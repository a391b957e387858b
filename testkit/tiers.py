"""The two test tiers: `make test` runs every test (what CI runs); `make test-fast`
(`pytest -m "not heavy"`) runs the units that need no real model, no services and start no
process, for the edit loop.

Why `heavy` is derived rather than written on each test: a hand-kept list rots silently. At
collection every test gets `heavy` that carries a marker of a heavy kind (`HEAVY_MARKERS`),
uses the real model's fixtures, or whose source, or its fixtures' or the suite's helpers they
call, names a way to start a process or the real model (`SPAWN_WORDS`, `MODEL_WORDS`);
`HEAVY_NODES` lists the few that start one only inside product code. What this static look
misses, the run catches: in the fast tier, starting a process fails the test, saying to mark
it. tests/conftest.py imports these hooks.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType

import pytest

HEAVY = "heavy"
FAST_EXPRESSION = f"not {HEAVY}"
# markers that mean "not in the edit loop": the model, real servers, long runs, lint, processes
HEAVY_MARKERS = frozenset({"model", "postgres", "redis", "soak", "style", "subprocess"})
MODEL_FIXTURES = frozenset({"smollm_checkpoint", "smollm_engine", "hf_smollm"})
SPAWN_WORDS = ("subprocess", "Popen", "GatewayProcess", "ServerProcess", "multiprocessing",
               "postgres_server", "redis_server", "scraped_gateway", "ray.", "Gateway(",
               "os.fork", "pexpect", "tmux")
MODEL_WORDS = ("default_model_path", "DEFAULT_GGUF")
# tests that start a process only through product code (the scan follows only the suite's and
# testkit's own functions): found by the fast tier's run-time refusal
HEAVY_NODES = (
    "tests/gateway/test_telemetry.py::test_request_span_tree_and_attributes",  # worker processes
    "tests/gateway/test_telemetry.py::test_metrics_parse_as_prometheus_text",
    "tests/gateway/test_telemetry.py::test_live_feed_sends_hello_snapshots_and_spans",
    "tests/gateway/test_telemetry.py::test_otlp_export_reaches_a_collector",
    "tests/runtime/test_engine_contract.py::test_every_engine_keeps_the_contract[model-worker-",
    "tests/runtime/test_engine_contract.py::test_every_engine_keeps_the_contract[fake-worker-",
    "tests/kernels/test_cpu_ops.py::test_a_source_that_does_not_compile_is_reported_not_loaded",
    "tests/kernels/test_cpu_ops.py::test_the_library_is_cached_by_source",  # the C compiler
    "tests/kernels/test_prebuilt.py::test_make_kernels_builds_the_avx2_library",
)
ROOT = Path(__file__).resolve().parent.parent
HELPER_DIRS = (str(ROOT / "tests") + os.sep, str(ROOT / "testkit") + os.sep)
_SCANNED: dict[object, str | None] = {}


class HeavyInFastTier(RuntimeError):
    """A test of the fast tier started a process."""


def fast_tier(config: pytest.Config) -> bool:
    """Whether this run is the fast tier: its -m expression deselects `heavy`."""
    return FAST_EXPRESSION in (config.getoption("markexpr", "") or "")


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _helper(obj: object) -> bool:
    """A module, function or class of the suite or of testkit: the scan follows what these call
    (a module is read whole)."""
    if inspect.ismodule(obj):
        path = getattr(obj, "__file__", None)
    elif inspect.isclass(obj):
        path = getattr(sys.modules.get(obj.__module__), "__file__", None)
    else:
        code = getattr(obj, "__code__", None)
        path = code.co_filename if code is not None else None
    return bool(path) and str(path).startswith(HELPER_DIRS)


def _names(code: CodeType) -> Iterator[str]:
    """The global names a function's code (nested functions included) refers to."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def _heavy_word(obj: object) -> str | None:
    """A word of SPAWN_WORDS or MODEL_WORDS in the source of `obj` or of a helper it calls."""
    if obj in _SCANNED:
        return _SCANNED[obj]
    _SCANNED[obj] = None  # a helper calling itself back adds nothing
    text = _source(obj)
    word = next((w for w in SPAWN_WORDS + MODEL_WORDS if w in text), None)
    code, namespace = getattr(obj, "__code__", None), getattr(obj, "__globals__", {})
    for name in sorted(set(_names(code))) if code is not None and word is None else ():
        target = namespace.get(name)
        if target is not None and _helper(target):
            word = _heavy_word(target)
            if word:
                break
    _SCANNED[obj] = word
    return word


def _fixture_functions(item: pytest.Item) -> Iterator[tuple[str, Callable]]:
    """Each fixture the test uses, directly or through other fixtures, defined in this repo."""
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        yield from ((name, d.func) for d in defs if _helper(d.func))


def heavy_reason(item: pytest.Item) -> str | None:
    """Why a test is heavy, or None for a fast one."""
    marked = HEAVY_MARKERS.intersection(m.name for m in item.iter_markers())
    if marked:
        return f"marked {sorted(marked)[0]}"
    if item.nodeid.startswith(HEAVY_NODES):
        return "listed in testkit.tiers.HEAVY_NODES"
    model = MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if model:
        return f"uses the real model's fixture {sorted(model)[0]}"
    scanned = [("the test", getattr(item, "function", None))]
    scanned += [(f"fixture {name}", func) for name, func in _fixture_functions(item)]
    for where, obj in scanned:
        word = _heavy_word(obj) if obj is not None else None
        if word:
            return f"{where} (or a helper it calls) mentions {word!r}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add `heavy` before `-m` deselects (tryfirst: ahead of pytest's own mark plugin)."""
    for item in items:
        reason = heavy_reason(item)
        if reason:
            item.add_marker(pytest.mark.heavy(reason=reason))


def pytest_sessionstart(session: pytest.Session) -> None:
    """The fast tier builds the C kernels (kernels/cpu_build.py) before it refuses processes, so
    the first tiny-model test on a fresh machine does not meet the compiler's process."""
    if fast_tier(session.config):
        from kernels import cpu_build
        cpu_build.load()


@contextlib.contextmanager
def _refusing(item: pytest.Item, seen: list[str]) -> Iterator[None]:
    """Process starts refused (and recorded) while a fast test runs."""
    import _posixsubprocess

    def refuse(what: str) -> Callable:
        def refused(*args, **kwargs):
            seen.append(what)
            raise HeavyInFastTier(f"{item.nodeid} {what} in the fast tier: mark it "
                                  "@pytest.mark.subprocess (or list it in HEAVY_NODES, "
                                  "testkit/tiers.py)")
        return refused

    # subprocess binds fork_exec at import (as _fork_exec); multiprocessing calls it by attribute
    patches: list[tuple[object, str, str]] = [
        (subprocess, "_fork_exec", "starts a process"),
        (_posixsubprocess, "fork_exec", "starts a process"), (os, "fork", "forks"),
        (os, "posix_spawn", "starts a process"), (os, "posix_spawnp", "starts a process")]
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, what in patches:
            mp.setattr(owner, name, refuse(what))
        yield


def _guarded(item: pytest.Item):
    if not fast_tier(item.config):
        return (yield)
    seen: list[str] = []
    with _refusing(item, seen):
        result = yield
    if seen:
        pytest.fail(f"{item.nodeid} {seen[0]} in the fast tier: mark it (testkit/tiers.py)")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item))
