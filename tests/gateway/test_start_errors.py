"""Every kind of start-up error stops `python -m gateway` with one line on stderr naming what to
change, a non-zero exit and no traceback, within 10 seconds; --debug adds the traceback.

Most are refused before any worker starts: flag, variable and --config values, the key and
price files, the port, the engine settings this machine cannot serve (a CUDA device under a
CPU-only torch, a disk-cache folder that cannot be written, a chat template), the shared stores,
Ray. What only a worker can know (a --max-model-len over the model's context) is its one line,
which the gateway reports before stopping. A key file broken after the start is not a start
error: SIGHUP logs one line and the old keys stay in use.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from contract.engine_settings import torch_build_has_gpu
from contract.errors import StartError
from gateway.app import check_ray_cluster
from gateway.supervisor import check_port
from testkit.gateway_server import free_port
from tests.gateway.keyfile import write_key_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 10.0  # seconds: the bound for a start that cannot succeed


def run_gateway(*flags: str, env: dict | None = None, tmp_path=None,
                timeout: float = 30.0) -> tuple[int, list[str], float]:
    """(exit status, stderr lines, seconds) of a gateway that is expected to stop by itself."""
    environ = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    ledger = ["--ledger-path", str(tmp_path / "ledger.sqlite3")] if tmp_path else []
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gateway", "--port", str(free_port()),
                           *ledger, *flags],
                          cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - start


def assert_one_line(result: tuple[int, list[str], float], *fragments: str) -> str:
    code, lines, seconds = result
    assert code != 0
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert len(lines) == 1, "\n".join(lines)
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert seconds < LIMIT, seconds
    return lines[0]


@pytest.fixture
def held_port():
    """A port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ---- the port ------------------------------------------------------------------------------

def test_a_port_in_use(tmp_path, held_port):
    line = assert_one_line(run_gateway("--fake", "--port", str(held_port), tmp_path=tmp_path))
    assert line == (f"cannot listen on 127.0.0.1:{held_port}: address already in use "
                    f"(another server? choose --port)")


def test_a_port_in_use_stops_a_fleet_before_its_workers_load(held_port):
    """--gateways N binds the port in each gateway (SO_REUSEPORT), after the shared workers
    loaded: the supervisor tries it first."""
    with pytest.raises(StartError, match=f"cannot listen on 127.0.0.1:{held_port}: address "
                                         f"already in use"):
        check_port("127.0.0.1", held_port)
    check_port("127.0.0.1", free_port())


def test_a_port_out_of_range(tmp_path):
    assert_one_line(run_gateway("--fake", "--port", "70000", tmp_path=tmp_path),
                    "--port takes 0 to 65535, not 70000")


def test_the_traceback_with_debug(tmp_path, held_port):
    code, lines, _ = run_gateway("--fake", "--debug", "--port", str(held_port),
                                 tmp_path=tmp_path)
    assert code == 1
    assert lines[0] == "Traceback (most recent call last):"
    assert any("OSError" in line for line in lines)  # the cause, chained
    assert lines[-1].startswith(f"cannot listen on 127.0.0.1:{held_port}")


# ---- settings: flags, variables, --config --------------------------------------------------

@pytest.mark.parametrize("flags,env,expected", [
    (["--port", "abc"], {}, "--port takes a whole number, not 'abc'"),
    ([], {"INFERSTACK_MAX_NUM_SEQS": "x"}, "INFERSTACK_MAX_NUM_SEQS takes a whole number, "
                                           "not 'x'"),
    ([], {"INFERSTACK_KV_CACHE_GB": "lots"}, "INFERSTACK_KV_CACHE_GB takes a number"),
    ([], {"INFERSTACK_TELEMETRY": "maybe"}, "INFERSTACK_TELEMETRY takes true or false"),
    (["--max-model-len", "0"], {}, "max_model_len must be >= 1"),
], ids=["flag", "variable-int", "variable-float", "variable-bool", "engine-value"])
def test_a_bad_value(tmp_path, flags, env, expected):
    assert_one_line(run_gateway("--fake", *flags, env=env, tmp_path=tmp_path), expected)


@pytest.mark.parametrize("text,expected", [
    (None, "cannot read it (No such file or directory)"),
    ("port = [", "not valid TOML"),
    ("prot = 8000\n", "unknown settings in"),
    ('port = "abc"\n', "port in {path} takes a whole number, not 'abc'"),
    ("model = 5\n", "model in {path} takes text, not 5"),
], ids=["missing", "malformed", "unknown", "wrong-type", "not-text"])
def test_a_bad_config_file(tmp_path, text, expected):
    path = tmp_path / "gateway.toml"
    if text is not None:
        path.write_text(text)
    assert_one_line(run_gateway("--fake", "--config", str(path), tmp_path=tmp_path),
                    expected.format(path=path))


# ---- files the gateway reads ---------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    (None, "cannot read the key file (No such file or directory)"),
    ("[[keys]\n", "not valid TOML"),
    ('[tenants.a]\n[[keys]]\nsha256 = "abc"\ntenant = "a"\n', "line 2: sha256 must be 64"),
    ("[tenants.a]\nweight = 1\n", "no [[keys]] entries"),
], ids=["missing", "malformed", "bad-hash", "no-keys"])
def test_a_bad_key_file(tmp_path, text, expected):
    path = tmp_path / "keys.toml"
    if text is not None:
        path.write_text(text)
    assert_one_line(run_gateway("--fake", "--keys-file", str(path), tmp_path=tmp_path),
                    f"--keys-file {path}", expected)


def test_a_folder_as_the_key_file(tmp_path):
    folder = tmp_path / "keys.toml"  # what a compose bind mount of a missing file leaves
    folder.mkdir()
    assert_one_line(run_gateway("--fake", "--keys-file", str(folder), tmp_path=tmp_path),
                    f"--keys-file {folder}", "Is a directory")


def test_a_ledger_folder_that_cannot_be_written(tmp_path):
    (tmp_path / "a-file").write_text("")
    ledger = tmp_path / "a-file" / "ledger.sqlite3"
    assert_one_line(run_gateway("--fake", "--ledger-path", str(ledger)),
                    f"--ledger-path {ledger}: its folder", "cannot write there")


def test_a_price_book_that_is_neither_preset_nor_file(tmp_path):
    assert_one_line(run_gateway("--fake", "--prices", "cheap", tmp_path=tmp_path),
                    "--prices cheap", "a preset: seed")


# ---- engine settings this machine cannot serve ---------------------------------------------

@pytest.mark.skipif(torch_build_has_gpu(), reason="this torch is built for a GPU")
def test_cuda_under_a_cpu_only_torch(tmp_path):
    line = assert_one_line(run_gateway("--device", "cuda", tmp_path=tmp_path),
                           "--device cuda: the installed torch", "is a CPU-only build")
    assert "--device cpu" in line


def test_a_disk_cache_folder_that_cannot_be_written(tmp_path):
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "kv"  # under a file: refused even to root
    assert_one_line(run_gateway("--fake", "--disk-cache-dir", str(folder), tmp_path=tmp_path),
                    f"--disk-cache-dir {folder}: cannot write there (Not a directory)")


def test_a_chat_template_file_that_is_missing(tmp_path):
    path = tmp_path / "chat.jinja"
    assert_one_line(run_gateway("--fake", "--chat-template", str(path), tmp_path=tmp_path),
                    f"--chat-template {path}: cannot read it (No such file or directory)")


def test_a_chat_template_that_does_not_compile(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}")
    assert_one_line(run_gateway("--fake", "--chat-template", str(path), tmp_path=tmp_path),
                    f"--chat-template {path}:", "'endfor'", "does not compile")


def test_a_context_over_the_models_is_the_workers_one_line(tmp_path, tiny_model_dir):
    """Only the worker knows the model's context: its one line, which the gateway reports
    once before exiting, with no restart and no traceback."""
    code, lines, seconds = run_gateway("--model", str(tiny_model_dir), "--max-model-len",
                                       "100000", tmp_path=tmp_path)
    assert code == 1 and seconds < LIMIT
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    named = [line for line in lines if "--max-model-len" in line]
    assert named == [lines[-1]], "\n".join(lines)
    assert lines[-1] == ("--max-model-len 100000 exceeds the context of tiny-llama (512 "
                         "tokens); give at most 512")


# ---- services the gateway connects to ------------------------------------------------------

def test_a_state_url_that_does_not_answer(tmp_path):
    line = assert_one_line(run_gateway(
        "--fake", "--state-url", f"postgresql://inferstack:s3cret@127.0.0.1:{free_port()}/db",
        tmp_path=tmp_path), "--state-url postgresql://inferstack:***@127.0.0.1:",
        "cannot reach PostgreSQL there")
    assert "s3cret" not in line


def test_a_redis_url_that_does_not_answer(tmp_path):
    assert_one_line(run_gateway("--fake", "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                                tmp_path=tmp_path), "cannot reach Redis there")


def test_a_redis_url_that_does_not_parse(tmp_path):
    assert_one_line(run_gateway("--fake", "--redis-url", "redis://[oops", tmp_path=tmp_path),
                    "--redis-url redis://...", "Invalid IPv6 URL")


def test_a_ray_address_without_ray_installed(tmp_path):
    shadow = tmp_path / "no-ray"
    shadow.mkdir()  # a `ray` that fails to import, as when the extra is not installed
    (shadow / "ray.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", "
                                   "name='ray')\n")
    assert_one_line(run_gateway("--ray-address", "auto", tmp_path=tmp_path,
                                env={"PYTHONPATH": f"{shadow}{os.pathsep}{ROOT}"}),
                    "--ray-address needs ray, which is not installed")


def test_a_ray_address_where_no_cluster_answers():
    """The gateway waits RAY_JOIN_SECONDS for a cluster started alongside it; then one line
    (ray.init alone would wait over a minute, printing its own warnings)."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(StartError, match=f"--ray-address {address}: no Ray cluster answers"):
        check_ray_cluster(address, patience=0.5)


# ---- a key file broken while serving -------------------------------------------------------

def _status(url: str, key: str) -> int:
    request = urllib.request.Request(url + "/v1/models",
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sighup_with_a_broken_key_file_logs_one_line_and_keeps_the_keys(tmp_path):
    keys = write_key_file(tmp_path / "keys.toml", {"a": {}}, [("sk-a", "a", True, False)])
    port = free_port()
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--fake", "--port", str(port), "--keys-file",
             keys, "--no-access-log", "--ledger-path", str(tmp_path / "ledger.sqlite3")],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _ready(url) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        (tmp_path / "keys.toml").write_text("[[keys]\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "not reloaded" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert _status(url, "sk-a") == 200  # the old keys serve on
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log_path.read_text()
    assert "Traceback" not in text, text
    (line,) = [line for line in text.splitlines() if "not reloaded" in line]
    assert " ERROR " in line and "not valid TOML" in line and "old keys stay in use" in line


def _ready(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
