"""The layering, checked on every module's imports (DESIGN.md section 3).

The gateway reaches the runtime only through `contract` (torch-free, importing nothing else of
ours), save the named process launch points in `LAUNCH_POINTS`; runtime never imports gateway
or billing; billing (the money) imports neither HTTP nor tensors; kernels import only kernels;
console and loadtest import neither gateway nor runtime; numeric imports nothing of ours.
The test helpers (testkit) may import anything of ours, but no product package imports them or
the suite, and neither testkit nor bench imports the suite (so a benchmark runs on its own).
Inside the gateway: http -> serving -> workers; nothing below the HTTP surface imports
`gateway.http` (only the app that composes it); workers import neither serving nor http;
telemetry's spans import neither http nor serving.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = ("contract", "billing", "gateway", "runtime", "kernels", "console", "loadtest", "numeric",
        "testkit")
# the shipped packages; testkit (helpers of the tests and benchmarks) is ours but not shipped code
PRODUCT = tuple(p for p in OURS if p != "testkit")
TEST_ONLY = ("testkit", "tests")

# a module whose name starts with the key may not import one starting with any of the values
FORBIDDEN = {
    "contract": ("runtime", "gateway", "billing", "kernels", "console", "loadtest", "numeric"),
    "billing": ("runtime", "gateway", "kernels", "console", "loadtest"),
    "gateway": ("runtime",),
    "runtime": ("gateway", "billing", "console", "loadtest"),
    "kernels": ("gateway", "runtime", "console", "loadtest"),
    "console": ("gateway", "runtime", "loadtest"),
    "loadtest": ("gateway", "runtime", "console"),
    "numeric": ("gateway", "runtime", "kernels", "console", "loadtest"),
    "gateway.serving": ("gateway.http",),
    "gateway.workers": ("gateway.http", "gateway.serving"),
    "gateway.telemetry.spans": ("gateway.http", "gateway.serving"),
    "gateway.openai": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.anthropic": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.config": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.errors": ("gateway.http", "gateway.serving", "gateway.workers"),
}

# lazy imports of a runtime process's entry point, made only in the mode that starts one: a Ray
# actor's class must be imported to be started, and `--pd` hosts the KV rendezvous's TCPStore
LAUNCH_POINTS = {
    ("gateway.workers.ray_handle", "runtime.transport.ray_worker"),
    ("gateway.app", "runtime.transport.ray_worker"),
    ("gateway.app", "runtime.transport.kv_rendezvous"),
}
# packages that must stay importable without the tensor libraries (the gateway's process)
TENSOR_FREE = ("contract", "billing", "gateway", "console", "loadtest")
TENSOR_LIBRARIES = ("torch", "triton", "numpy")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, roots: tuple[str, ...] = OURS) -> set[str]:
    """Every module under `roots` a file imports (module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in roots}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _files():
    for package in OURS:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_package_is_checked():
    assert {p.relative_to(ROOT).parts[0] for p in _files()} == set(OURS)


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layering(path):
    module = _module_name(path)
    bad = []
    for importer, banned in FORBIDDEN.items():
        if not _within(module, importer):
            continue
        bad += [name for name in _imports(path) for b in banned
                if _within(name, b) and not _launch_point(module, name)]
    assert not bad, f"{module} imports {sorted(set(bad))}, against the layering"


def _launch_point(module: str, name: str) -> bool:
    return any(module == importer and _within(name, target) for importer, target in LAUNCH_POINTS)


@pytest.mark.parametrize("path", [p for p in _files()
                                  if p.relative_to(ROOT).parts[0] in TENSOR_FREE],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_gateway_side_imports_no_tensor_library(path):
    found = _imports(path, TENSOR_LIBRARIES)
    assert not found, f"{_module_name(path)} imports {sorted(found)}: this side is torch-free"


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(ROOT).parts[0] in PRODUCT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_product_module_imports_the_test_helpers(path):
    found = _imports(path, TEST_ONLY)
    assert not found, f"{_module_name(path)} imports {sorted(found)}: test helpers stay out"


def test_testkit_and_bench_never_import_the_suite():
    files = sorted((ROOT / "testkit").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    bad = {str(p.relative_to(ROOT)): sorted(_imports(p, ("tests",))) for p in files}
    assert not {path: names for path, names in bad.items() if names}, "put it in testkit/"


def test_the_rule_catches_a_gateway_module_importing_the_runtime(tmp_path):
    """The rule's own check: a gateway module importing anything of runtime but a launch point
    fails it."""
    bad = tmp_path / "bad.py"
    bad.write_text("from runtime.execution.sampler import Sampler\n")
    assert _imports(bad) == {"runtime.execution.sampler", "runtime.execution.sampler.Sampler"}
    assert not _launch_point("gateway.serving.service", "runtime.execution.sampler")
    assert _launch_point("gateway.app", "runtime.transport.kv_rendezvous")
