"""Compiles kernels/cpu/*.c into one library once per source, compiler and CPU, and loads it.

The library is built at first use with the system's C compiler (about a second: one file, no
torch headers) into the user's cache, under a name that hashes the source and the flags, so an
edit or another machine's flags build a fresh copy and concurrent starts never see a half
written file (it is written aside, then renamed). It needs AVX2 and FMA; on a CPU without them,
or with no compiler, `load()` returns None with the reason in `unavailable_reason()`, and the
kernels fall back to the torch references (the choice is logged once).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("decode_ops.c", "block_ops.c", "f32_ops.c", "attention.c", "decode_layer.c")
BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# where the CPU has them, the block kernels run 16 lanes wide (block_ops.c); INFERSTACK_CPU_ISA=avx2
# builds the AVX2 variant anyway (the tests check both on an AVX-512 machine)
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

_state: dict[str, object] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferstack" / "cpu_kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa() -> str:
    """`avx512` where the CPU has the AVX-512 subsets the kernels use, else `avx2`."""
    if os.environ.get("INFERSTACK_CPU_ISA", "").lower() == "avx2":
        return "avx2"
    have = cpu_flags()
    return "avx512" if all(f[2:] in have for f in AVX512_FLAGS) else "avx2"


def flags() -> tuple[str, ...]:
    return BASE_FLAGS + (AVX512_FLAGS if isa() == "avx512" else ())


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def source_key(cc: str | None = None) -> str:
    """A hash of the sources (headers too), the compiler and the flags: names the library,
    and anything timed with it (runtime/loading/calibration.py, once per weight shape)."""
    return _source_key(cc or compiler() or "", SOURCE_DIR, flags())


@functools.cache
def _source_key(cc: str, source_dir: Path, build_flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(" ".join((cc,) + build_flags).encode())
    for path in sorted(source_dir.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _build(cc: str) -> Path:
    key = source_key(cc)
    target = cache_dir() / f"decode_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        sources = [str(SOURCE_DIR / name) for name in SOURCES]
        subprocess.run([cc, *flags(), *sources, "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (see `unavailable_reason`); built and loaded once."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib, reason = None, None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    cc = compiler()
    if missing:
        reason = f"the CPU lacks {', '.join(missing)}"
    elif cc is None:
        reason = "no C compiler (cc, gcc or clang) on PATH"
    else:
        import torch  # noqa: F401  (its libgomp must be loaded first: the library shares it)
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            reason = f"building {', '.join(SOURCES)} failed: {detail.strip()[:500]}"
    if reason:
        log.warning("CPU decode kernels off (%s); using the torch references", reason)
    _state["lib"], _state["reason"] = lib, reason
    return lib


def unavailable_reason() -> str | None:
    load()
    return _state["reason"]  # type: ignore[return-value]
