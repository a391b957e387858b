"""The layering, checked on every module's imports (DESIGN.md section 3).

runtime never imports gateway; kernels import only kernels; console and loadtest import neither
gateway nor runtime; numeric imports nothing of ours. Inside the gateway: http -> serving ->
workers; nothing below the HTTP surface imports `gateway.http` (only the app that composes
it); workers import neither serving nor http; billing and telemetry import neither http nor
serving.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = ("gateway", "runtime", "kernels", "console", "loadtest", "numeric")

# a module whose name starts with the key may not import one starting with any of the values
FORBIDDEN = {
    "runtime": ("gateway", "console", "loadtest"),
    "kernels": ("gateway", "runtime", "console", "loadtest"),
    "console": ("gateway", "runtime", "loadtest"),
    "loadtest": ("gateway", "runtime", "console"),
    "numeric": ("gateway", "runtime", "kernels", "console", "loadtest"),
    "gateway.serving": ("gateway.http",),
    "gateway.workers": ("gateway.http", "gateway.serving"),
    "gateway.billing": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.telemetry.spans": ("gateway.http", "gateway.serving"),
    "gateway.openai": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.config": ("gateway.http", "gateway.serving", "gateway.workers"),
    "gateway.errors": ("gateway.http", "gateway.serving", "gateway.workers"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module of ours a file imports (module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in OURS}


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
        bad += [name for name in _imports(path) for b in banned if _within(name, b)]
    assert not bad, f"{module} imports {sorted(set(bad))}, against the layering"
