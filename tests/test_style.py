"""Style in CI: `ruff check .` and `mypy` (both configured in pyproject.toml) report nothing.

Run alone with `pytest -m style` (or `pytest tests/test_style.py`).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.style


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=540)


def test_ruff_reports_nothing():
    done = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    assert done.returncode == 0, f"ruff check . found problems:\n{done.stdout}{done.stderr}"


def test_mypy_reports_nothing():
    done = _run("mypy")  # the packages and settings come from [tool.mypy]
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"
