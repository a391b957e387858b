"""The ctypes bindings (kernels/cpu_api.py) against the C API's header (kernels/cpu/api.h), the
header against the C definitions, and the built library's exports against both: a binding out
of step with its C function would pass garbage through a pointer, not fail."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from kernels import cpu_api, cpu_build
from tests.kernels import c_api_check

HEADER = cpu_build.SOURCE_DIR / "api.h"
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
needs_cc = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler on PATH")


def _header() -> c_api_check.Header:
    return c_api_check.parse(HEADER.read_text())


def _problems(signatures=None, structs=None, header=None) -> list[str]:
    return c_api_check.check(header or _header(), signatures or cpu_api.SIGNATURES,
                             structs or cpu_api.STRUCTS)


def test_the_ctypes_tables_match_the_header():
    header = _header()
    assert len(header.functions) >= 11 and "AttentionArgs" in header.structs
    assert _problems(header=header) == []


def _swapped(name: str, i: int, j: int) -> dict:
    table = {k: (list(args), result) for k, (args, result) in cpu_api.SIGNATURES.items()}
    args = table[name][0]
    assert args[i] is not args[j], "swap two arguments of different types"
    args[i], args[j] = args[j], args[i]
    return table


@pytest.mark.parametrize("name,i,j", [("is_rms_norm", 9, 10), ("is_block_linear", 3, 4),
                                      ("is_decode_attention", 0, 1), ("is_rotary", 5, 6)])
def test_two_swapped_argument_types_are_reported(name, i, j):
    problems = _problems(signatures=_swapped(name, i, j))
    assert f"{name} argument {i}: " in "\n".join(problems)
    assert f"{name} argument {j}: " in "\n".join(problems)
    assert all(p.startswith(name) for p in problems)


def _edited(change) -> dict:
    table = {k: (list(args), result) for k, (args, result) in cpu_api.SIGNATURES.items()}
    change(table)
    return table


@pytest.mark.parametrize("change,expected", [
    (lambda t: t.pop("is_store_kv"), "function is_store_kv: in the header, missing from"),
    (lambda t: t.update(is_extra=([_P], None)), "function is_extra: in the ctypes table, miss"),
    (lambda t: t.update(is_rotary=(t["is_rotary"][0][:-1], None)), "is_rotary: 8 arguments in"),
    (lambda t: t.update(is_decode_layer=(t["is_decode_layer"][0], None)),
     "is_decode_layer result: the header says c_int, ctypes void"),
    (lambda t: t["is_prefill_attention"][0].__setitem__(0, _P),
     "is_prefill_attention argument 0: the header says LP_AttentionArgs, ctypes c_void_p"),
])
def test_a_missing_extra_or_mistyped_function_is_reported(change, expected):
    assert any(p.startswith(expected) for p in _problems(signatures=_edited(change))), expected


def _mirror(name: str, fields) -> type:
    """A stand-in for one of cpu_api's structs (same name) with other fields."""
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _struct_problems(structs) -> list[str]:
    """(The table's pointers still name the real classes: those lines are left out.)"""
    return [p for p in _problems(structs=structs) if p.startswith("struct")]


def test_a_struct_out_of_step_with_the_header_is_reported():
    fields = list(cpu_api.AttentionArgs._fields_)
    at = [name for name, _ in fields].index("scale")
    fields[at] = ("scale", _I)  # float in C
    structs = tuple(_mirror("AttentionArgs", fields) if c is cpu_api.AttentionArgs else c
                    for c in cpu_api.STRUCTS)
    assert _struct_problems(structs) == [
        "struct AttentionArgs.scale: the header says c_float, ctypes c_long"]
    fields = list(cpu_api.StoreKVArgs._fields_)
    fields[2], fields[3] = fields[3], fields[2]  # two int64 fields in the other order
    structs = tuple(_mirror("StoreKVArgs", fields) if c is cpu_api.StoreKVArgs else c
                    for c in cpu_api.STRUCTS)
    assert [p.split(":")[0] for p in _struct_problems(structs)] == ["struct StoreKVArgs"]
    dropped = tuple(c for c in cpu_api.STRUCTS if c is not cpu_api.StepCache)
    assert "struct StepCache: in the header, missing from the ctypes table" in \
        _problems(structs=dropped)


def test_a_header_edit_without_the_table_is_reported():
    text = HEADER.read_text()
    swapped = text.replace("is_block_dequantize(const uint8_t *qs, int format,",
                           "is_block_dequantize(int format, const uint8_t *qs,")
    assert swapped != text
    problems = _problems(header=c_api_check.parse(swapped))
    assert {p.split(":")[0] for p in problems} == {"is_block_dequantize argument 0",
                                                   "is_block_dequantize argument 1"}
    renamed = text.replace("int64_t k_row, k_head", "int64_t k_rows, k_head")
    assert renamed != text
    assert _problems(header=c_api_check.parse(renamed))[0].startswith("struct StoreKVArgs")


def _block_formats(text: str) -> dict[str, int]:
    """The header's BLOCK_* enum: name = value pairs."""
    body = re.search(r"enum\s*\{(?P<body>[^{}]*BLOCK_[^{}]*)\}", text)
    assert body, "api.h declares no BLOCK_* enum"
    return {name: int(value) for name, value in
            re.findall(r"(BLOCK_\w+)\s*=\s*(\d+)", body["body"])}


def test_the_block_format_codes_match_the_header():
    """The codes Python passes as `format` (block_ops.c reads them) are api.h's enum: a
    code out of step would multiply by a weight read in another layout."""
    assert _block_formats(HEADER.read_text()) == cpu_api.BLOCK_FORMATS
    edited = HEADER.read_text().replace("BLOCK_Q6_K = 14", "BLOCK_Q6_K = 15")
    assert _block_formats(edited) != cpu_api.BLOCK_FORMATS


def test_the_parser_reads_what_it_does_not_map_as_an_error():
    header = c_api_check.parse("typedef struct { char *name; short n; } Odd;\n"
                               "IS_API short is_odd(const Odd *o, unsigned int k);\n")
    assert header.structs["Odd"][1][1] == c_api_check.CType("short", 0)
    assert header.functions["is_odd"][1][1] == c_api_check.CType("unsigned int", 0)
    odd = _mirror("Odd", [("name", _P), ("n", ctypes.c_short)])
    problems = c_api_check.check(header, {"is_odd": ([ctypes.POINTER(odd), _I], _C)}, (odd,))
    assert "struct Odd.n: no ctypes type for short" in problems
    assert "is_odd: no ctypes type for short" in problems


@needs_cc
def test_struct_layouts_match_the_compiler(tmp_path):
    """Sizes and offsets as the C compiler lays the structs out, against ctypes'."""
    (tmp_path / "probe.c").write_text(c_api_check.layout_probe(_header(), str(HEADER)))
    cc = cpu_build.compiler()
    subprocess.run([cc, "-std=c11", str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")],
                   check=True, capture_output=True, timeout=60)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    compiled = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    assert compiled == c_api_check.ctypes_layout(cpu_api.STRUCTS)


def _syntax_check(source_dir, name: str, isa: str) -> subprocess.CompletedProcess:
    """One source compiled against its headers, every warning an error: a definition whose
    type differs from its prototype, or an exported function without one, fails."""
    build = [f for f in cpu_build.BASE_FLAGS if f != "-shared"]
    wide = list(cpu_build.AVX512_FLAGS) if isa == "avx512" else []
    return subprocess.run([cpu_build.compiler(), *build, *wide, "-fsyntax-only", "-Wall",
                           "-Wextra", "-Wmissing-prototypes", "-Werror",
                           str(source_dir / name)], capture_output=True, text=True, timeout=120)


@needs_cc
@pytest.mark.parametrize("isa", cpu_build.ISAS)
def test_every_definition_matches_its_prototype(isa):
    for name in cpu_build.SOURCES:
        done = _syntax_check(cpu_build.SOURCE_DIR, name, isa)
        assert done.returncode == 0, done.stderr[-2000:]


@needs_cc
@pytest.mark.parametrize("old,new,error", [
    ("void is_rotary(float *x, int64_t T,", "void is_rotary(float *x, int T,", "conflicting"),
    ("void is_rotary(float *x,", "void is_rotary_again(void) {}\nvoid is_rotary(float *x,",
     "no previous prototype"),
])
def test_a_definition_out_of_step_with_the_header_does_not_compile(tmp_path, old, new, error):
    for path in cpu_build.SOURCE_DIR.iterdir():
        shutil.copy(path, tmp_path / path.name)
    source = tmp_path / "decode_ops.c"
    text = source.read_text()
    assert old in text
    source.write_text(text.replace(old, new))
    done = _syntax_check(tmp_path, "decode_ops.c", "avx2")
    assert done.returncode != 0 and error in done.stderr


def test_the_library_exports_exactly_the_header_and_the_table():
    lib = cpu_build.load()
    if lib is None or shutil.which("nm") is None:
        pytest.skip(f"no library or no nm: {cpu_build.unavailable_reason()}")
    out = subprocess.run(["nm", "-D", "--defined-only", lib._name], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[1] == "T"}
    assert exported == set(_header().functions) == set(cpu_api.SIGNATURES)
