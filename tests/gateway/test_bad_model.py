"""A `--model` that can never load stops the gateway with one line on stderr and a non-zero
exit, quickly, instead of serving 503s and restarting its worker forever.

Missing paths, folders without config.json, files that are not GGUF and truncated GGUF headers
are refused before any worker starts (contract/model_files.check_model_path, no torch); a GGUF
whose header passes but whose contents do not load fails in the worker, which says so in one
line (ModelLoadError) that the gateway reports before exiting.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_gateway(model: str, tmp_path, timeout: float = 10.0) -> tuple[int, list[str], float]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "--model", model, "--port", "0",
         "--ledger-path", str(tmp_path / "ledger.sqlite3")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - start


def gguf_header(version: int = 3, tensors: int = 0, kvs: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def assert_one_line(code: int, lines: list[str], path: str) -> None:
    assert code != 0
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert len(lines) == 1, "\n".join(lines)
    assert path in lines[0]
    assert "expected a .gguf file or a Hugging Face model folder" in lines[0]


def test_missing_path(tmp_path):
    path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub name: downloads are not supported
    code, lines, _ = run_gateway(path, tmp_path)
    assert_one_line(code, lines, path)
    assert lines[0].startswith(f"--model {path}: no such file or folder")
    assert "downloads are not supported" in lines[0]


def test_folder_without_config_json(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"{}")
    code, lines, _ = run_gateway(str(folder), tmp_path)
    assert_one_line(code, lines, str(folder))
    assert "without config.json" in lines[0]


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("<html>not a model</html>\n")
    code, lines, _ = run_gateway(str(path), tmp_path)
    assert_one_line(code, lines, str(path))
    assert "not a GGUF file" in lines[0]


def test_truncated_gguf_header(tmp_path):
    path = tmp_path / "cut.Q4_0.gguf"
    path.write_bytes(gguf_header()[:10])
    code, lines, _ = run_gateway(str(path), tmp_path)
    assert_one_line(code, lines, str(path))
    assert "truncated" in lines[0]


@pytest.mark.parametrize("content", [
    gguf_header(tensors=1, kvs=5),  # promises metadata and a tensor, then ends
    gguf_header(),  # a well-formed header with no model in it
], ids=["truncated", "empty"])
def test_corrupt_gguf_fails_in_the_worker_and_stops(tmp_path, content):
    """The header passes the gateway's check; the worker's load fails with a ModelLoadError
    that the gateway reports once before exiting 1, with no restart and no traceback."""
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    code, lines, seconds = run_gateway(str(path), tmp_path)
    assert code == 1
    assert seconds < 10
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    named = [line for line in lines if str(path) in line]
    assert len(named) == 1, "\n".join(lines)
    assert lines[-1] == named[0]
    assert not any("retrying" in line or "failed to start" in line for line in lines)
