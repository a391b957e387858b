"""Builds kernels/cpu/*.c into one library per source, compiler and ISA, and loads it.

`make kernels` (python -m kernels.cpu_build) builds it ahead of time into the environment's
own prefix (`prebuilt_dir()`: .venv/lib/inferstack-kernels/, ignored with the venv), once
per ISA this CPU runs. A library is named by a hash of the sources (headers too), the compiler
and the flags, so an edit or another torch makes the prebuilt one stale by name alone; a
process that finds none for its key falls back to building at first use (a few seconds
on the 2-core VM) into the user's cache, as before `make kernels` existed. A build is written
aside and renamed, so concurrent starts never see a half-written file. The kernels need AVX2,
FMA and F16C; on a CPU without them, or with no compiler, `load()` returns None with the
reason in `unavailable_reason()`, and the kernels fall back to the torch references.

OpenMP: compiled with -fopenmp and linked against torch's own libgomp (-l:<its file>) with
an rpath to torch's lib directory. One OpenMP runtime per process matters on these 2-core
machines (two pools of busy-waiting threads oversubscribe the cores), and libgomp.so.1 is
shared by soname, so whichever copy loads first serves both torch and us. The rpath makes that
torch's copy in any import order (before, torch had to be imported first), and the link checks
our OpenMP calls against the runtime that will run them. Measured on the 2-core VM (best of
7): the plain -fopenmp link also loads one runtime (torch's copy is named libgomp.so.1 too),
but the system's when the library loads first; timings alike either way (int8 GEMV 8192x2048
0.61-0.65 ms, torch's 64x2048x2048 GEMM 2.3-2.4 ms, the two in turn 3.0-3.3 ms).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("decode_ops.c", "block_ops.c", "f32_ops.c", "attention.c", "decode_layer.c")
# -fvisibility=hidden: only api.h's IS_API functions are exported (tests/kernels/
# test_bindings.py compares the export list with the header and the ctypes table)
# -ffp-contract=off: a product and a sum stay two roundings (the K-quants' dequantization must
# round as ggml's does, block_ops.c); the ISO mode -std=c11 implies it with GCC, not with clang
BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11",
              "-fvisibility=hidden", "-ffp-contract=off")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# where the CPU has them, the block kernels run 16 lanes wide (block_ops.c); INFERSTACK_CPU_ISA=avx2
# loads the AVX2 variant anyway (the tests check both on an AVX-512 machine)
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
ISAS = ("avx512", "avx2")

_state: dict[str, object] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferstack" / "cpu_kernels"


def prebuilt_dir() -> Path:
    """Where `make kernels` puts the libraries: inside the environment whose torch they link."""
    return Path(sys.prefix) / "lib" / "inferstack-kernels"


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


def cpu_isas() -> tuple[str, ...]:
    """The ISAs this CPU runs: AVX-512 where it has the subsets the kernels use, and AVX2."""
    have = cpu_flags()
    return ISAS if all(f[2:] in have for f in AVX512_FLAGS) else ("avx2",)


def isa() -> str:
    """The ISA this process loads: the CPU's widest, or `avx2` if INFERSTACK_CPU_ISA says so."""
    if os.environ.get("INFERSTACK_CPU_ISA", "").lower() == "avx2":
        return "avx2"
    return cpu_isas()[0]


@functools.cache
def torch_openmp() -> tuple[str, ...]:
    """Link flags for torch's bundled libgomp (the module docstring says why), found without
    importing torch; empty where torch bundles none (then the compiler's own, by soname)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ()
    lib_dir = Path(spec.origin).parent / "lib"
    found = sorted(lib_dir.glob("libgomp*.so*"))
    if not found:
        return ()
    return (f"-L{lib_dir}", f"-l:{found[0].name}", f"-Wl,-rpath,{lib_dir}")


def flags(isa_name: str | None = None) -> tuple[str, ...]:
    """Compile and link flags for one ISA (this process's by default)."""
    wide = AVX512_FLAGS if (isa_name or isa()) == "avx512" else ()
    return BASE_FLAGS + wide + torch_openmp()


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def source_key(cc: str | None = None, isa_name: str | None = None) -> str:
    """A hash of the sources (headers too), the compiler and the flags: names the library,
    and anything timed with it (runtime/loading/calibration.py, once per weight shape)."""
    return _source_key(cc or compiler() or "", SOURCE_DIR, flags(isa_name))


@functools.cache
def _source_key(cc: str, source_dir: Path, build_flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(" ".join((cc,) + build_flags).encode())
    for path in sorted(source_dir.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def library_name(key: str) -> str:
    return f"decode_ops-{key}.so"


def _build(cc: str, isa_name: str | None = None, directory: Path | None = None) -> Path:
    """The library for this ISA in `directory` (the user's cache by default), built if absent."""
    target = (directory or cache_dir()) / library_name(source_key(cc, isa_name))
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    build_flags = flags(isa_name)
    link = tuple(f for f in build_flags if f in torch_openmp())  # after the objects that use it
    compile_flags = tuple(f for f in build_flags if f not in link)
    try:
        sources = [str(SOURCE_DIR / name) for name in SOURCES]
        subprocess.run([cc, *compile_flags, *sources, "-o", tmp, *link, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users off a shared prebuilt
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _library(cc: str) -> Path:
    """The prebuilt library for this process's key, else one built into the user's cache."""
    key = source_key(cc)
    prebuilt = prebuilt_dir() / library_name(key)
    if prebuilt.exists():
        return prebuilt
    others = list(prebuilt_dir().glob(library_name("*")))
    log.info("%s CPU kernels in %s (run `make kernels`); building into %s",
             "stale" if others else "no prebuilt", prebuilt_dir(), cache_dir())
    return _build(cc)


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (see `unavailable_reason`); found or built, loaded once."""
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
        try:
            lib = ctypes.CDLL(str(_library(cc)))
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


def _prune(directory: Path, cc: str) -> None:
    """Drops the libraries of older sources or flags, keeping every ISA's current one."""
    keep = {library_name(source_key(cc, name)) for name in ISAS}
    for path in directory.glob(library_name("*")):
        if path.name not in keep:
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    """`make kernels`: the libraries for this CPU's ISAs (or `--isa`) into `prebuilt_dir()`.
    No compiler or a CPU without AVX2 is not an error (the runtime uses the references then);
    a source that does not compile is."""
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_build", description=main.__doc__)
    parser.add_argument("--isa", choices=("native",) + ISAS + ("all",), default="native")
    parser.add_argument("--dir", type=Path, default=prebuilt_dir())
    args = parser.parse_args(argv)
    cc, missing = compiler(), [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if cc is None or (missing and args.isa == "native"):
        why = "no C compiler on PATH" if cc is None else f"the CPU lacks {', '.join(missing)}"
        print(f"CPU kernels not built ({why}): the torch references will run")
        return 0
    isas = {"native": cpu_isas(), "all": ISAS}.get(args.isa, (args.isa,))
    for name in isas:
        try:
            path = _build(cc, name, args.dir)
        except subprocess.CalledProcessError as exc:
            print(f"building the {name} CPU kernels failed:\n{exc.stderr}", file=sys.stderr)
            return 1
        print(f"CPU kernels ({name}): {path}")
    _prune(args.dir, cc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
