"""The library `make kernels` builds (python -m kernels.cpu_build): loaded first when its key
matches, the user's cache at first use when it is missing or stale, both ISAs producible, and
one OpenMP runtime, torch's, whichever loads first."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest

from kernels import cpu_build

pytestmark = pytest.mark.skipif(cpu_build.load() is None,
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")


@pytest.fixture
def dirs(monkeypatch, tmp_path):
    """A private prebuilt directory and user cache, and a fresh load."""
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    prebuilt.mkdir()
    monkeypatch.setattr(cpu_build, "prebuilt_dir", lambda: prebuilt)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(cpu_build, "_state", {})
    return prebuilt, cache


# the library this process loaded at import, before any test's fresh load (`dirs`)
_LOADED = getattr(cpu_build.load(), "_name", "")


def _place(directory, isa_name=None):
    """The loaded library copied in under this key's name (a stand-in for a build)."""
    name = cpu_build.library_name(cpu_build.source_key(isa_name=isa_name))
    return shutil.copy(_LOADED, directory / name)


def test_the_prebuilt_library_is_loaded_first(dirs):
    prebuilt, cache = dirs
    placed = _place(prebuilt)
    assert cpu_build.load()._name == str(placed)
    assert not cache.exists()  # nothing built at first use


def test_a_stale_prebuilt_library_falls_back_to_a_build_in_the_cache(dirs, monkeypatch, caplog):
    prebuilt, cache = dirs
    (prebuilt / cpu_build.library_name("0123456789abcdef")).write_bytes(b"old")
    built = []

    def build(cc):  # as _build would, without the compile
        built.append(cc)
        cache.mkdir(parents=True)
        return _place(cache)
    monkeypatch.setattr(cpu_build, "_build", build)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        lib = cpu_build.load()
    assert built and lib._name.startswith(str(cache))
    assert "stale CPU kernels" in caplog.text and "make kernels" in caplog.text


def test_no_compiler_leaves_the_torch_fallback(dirs, monkeypatch, capsys):
    prebuilt, _ = dirs
    _place(prebuilt)
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    assert cpu_build.load() is None and "no C compiler" in cpu_build.unavailable_reason()
    assert cpu_build.main(["--dir", str(prebuilt)]) == 0  # make kernels does not fail
    assert "not built (no C compiler" in capsys.readouterr().out


def test_make_kernels_builds_the_avx2_library_and_drops_stale_ones(dirs, monkeypatch):
    prebuilt, cache = dirs
    stale = prebuilt / cpu_build.library_name("0123456789abcdef")
    stale.write_bytes(b"old")
    assert cpu_build.main(["--dir", str(prebuilt), "--isa", "avx2"]) == 0
    name = cpu_build.library_name(cpu_build.source_key(isa_name="avx2"))
    assert (prebuilt / name).exists() and not stale.exists()
    assert "-mavx512f" not in cpu_build.flags("avx2")
    if "avx512" in cpu_build.cpu_isas():
        assert cpu_build.source_key(isa_name="avx512") != cpu_build.source_key(isa_name="avx2")
    monkeypatch.setenv("INFERSTACK_CPU_ISA", "avx2")
    assert cpu_build.load()._name == str(prebuilt / name)
    assert not cache.exists()


OPENMP_ORDER = """
import ctypes, json, sys
def gomp():
    return sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l})
ctypes.CDLL(sys.argv[1])  # before torch
first = gomp()
import torch
torch.set_num_threads(2)
torch.randn(256, 256) @ torch.randn(256, 256)
print(json.dumps([first, gomp()]))
"""


@pytest.mark.skipif(not cpu_build.torch_openmp(), reason="torch bundles no libgomp here")
def test_one_openmp_runtime_torchs_even_when_the_library_loads_first():
    done = subprocess.run([sys.executable, "-c", OPENMP_ORDER, cpu_build.load()._name],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_lib = cpu_build.torch_openmp()[0][2:]
    first, after = json.loads(done.stdout)
    assert first == after and len(after) == 1 and after[0].startswith(torch_lib), done.stdout
