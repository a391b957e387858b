"""Parses the C declarations of kernels/cpu/api.h and compares them with the ctypes tables
(kernels/cpu_api.py), for tests/kernels/test_bindings.py.

A small parser of the subset the header uses (typedef'd structs of scalars, pointers and such
structs; prototypes of one line or many): comments and preprocessor lines are dropped, then
structs and prototypes are matched whole. Anything outside that subset is reported as an
unknown type rather than guessed, so a header that outgrows it fails the test loudly.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRUCT = re.compile(r"typedef\s+struct\s*\w*\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;")
_PROTO = re.compile(r"(?P<ret>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)\s*;")
_DECL = re.compile(r"^(?P<base>[\w\s]+?)\s*(?P<stars>[*\s]*)\b(?P<name>\w+)$")
_QUALIFIERS = {"const", "volatile", "struct", "IS_API", "extern"}
SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
           "float": ctypes.c_float, "double": ctypes.c_double, "uint64_t": ctypes.c_uint64}


@dataclass(frozen=True)
class CType:
    base: str  # without qualifiers: "float", "int64_t", "AttentionArgs"
    pointers: int

    def __str__(self) -> str:
        return self.base + (" " + "*" * self.pointers if self.pointers else "")


@dataclass
class Header:
    structs: dict[str, list[tuple[str, CType]]]  # name: fields in order
    functions: dict[str, tuple[CType, list[CType]]]  # name: (result, arguments)


def _ctype(base: str, stars: str) -> CType:
    words = [w for w in base.split() if w not in _QUALIFIERS]
    return CType(" ".join(words), stars.count("*"))


def _declarator(text: str) -> tuple[str, CType]:
    """`const float *x` as ("x", float *)."""
    m = _DECL.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse the declaration {text.strip()!r}")
    return m["name"], _ctype(m["base"], m["stars"])


def _fields(body: str) -> list[tuple[str, CType]]:
    """A struct's fields; `const float *cos, *sin` declares two of one base type."""
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        first, *rest = decl.split(",")
        name, ctype = _declarator(first)
        fields.append((name, ctype))
        for more in rest:
            stars = more.count("*")
            fields.append((more.replace("*", "").strip(), CType(ctype.base, stars)))
    return fields


def parse(text: str) -> Header:
    text = _COMMENT.sub(" ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    structs = {m["name"]: _fields(m["body"]) for m in _STRUCT.finditer(text)}
    functions = {}
    for m in _PROTO.finditer(_STRUCT.sub(" ", text)):
        params = m["params"].strip()
        args = [] if params in ("", "void") else [_declarator(p)[1] for p in params.split(",")]
        functions[m["name"]] = (_ctype(m["ret"].replace("*", " "), m["ret"]), args)
    return Header(structs, functions)


def to_ctypes(ctype: CType, structs: dict[str, type]):
    """The ctypes type a C type is passed as: a struct by its mirror, a pointer to one as
    POINTER(mirror), any other pointer as c_void_p; void as None."""
    if ctype.pointers == 0:
        if ctype.base == "void":
            return None
        if ctype.base in structs:
            return structs[ctype.base]
        if ctype.base in SCALARS:
            return SCALARS[ctype.base]
        raise KeyError(f"no ctypes type for {ctype}")
    if ctype.pointers == 1 and ctype.base in structs:
        return ctypes.POINTER(structs[ctype.base])
    return ctypes.c_void_p


def _name(t) -> str:
    return "void" if t is None else t.__name__


def _compare(what: str, want, got) -> list[str]:
    return [] if want is got else [f"{what}: the header says {_name(want)}, ctypes {_name(got)}"]


def _check_struct(name: str, fields, mirror, structs) -> list[str]:
    ours = [(f[0], f[1]) for f in mirror._fields_]
    if [f for f, _ in fields] != [f for f, _ in ours]:
        return [f"struct {name}: fields {[f for f, _ in fields]} in the header, "
                f"{[f for f, _ in ours]} in ctypes"]
    problems = []
    for (field, ctype), (_, got) in zip(fields, ours):
        try:
            problems += _compare(f"struct {name}.{field}", to_ctypes(ctype, structs), got)
        except KeyError as exc:
            problems.append(f"struct {name}.{field}: {exc.args[0]}")
    return problems


def _check_function(name: str, declared, signature, structs) -> list[str]:
    (result, args), (their_args, their_result) = declared, signature
    if len(args) != len(their_args):
        return [f"{name}: {len(args)} arguments in the header, {len(their_args)} in ctypes"]
    problems = []
    try:
        problems += _compare(f"{name} result", to_ctypes(result, structs), their_result)
        for i, (arg, theirs) in enumerate(zip(args, their_args)):
            problems += _compare(f"{name} argument {i}", to_ctypes(arg, structs), theirs)
    except KeyError as exc:
        problems.append(f"{name}: {exc.args[0]}")
    return problems


def _both_ways(kind: str, header: set[str], table: set[str]) -> list[str]:
    return ([f"{kind} {n}: in the header, missing from the ctypes table" for n in
             sorted(header - table)]
            + [f"{kind} {n}: in the ctypes table, missing from the header" for n in
               sorted(table - header)])


def check(header: Header, signatures: dict, mirrors) -> list[str]:
    """Every difference between the header and the ctypes tables, as sentences ([] if none):
    names both ways, then each common struct's fields and each common function's arguments
    and result."""
    structs = {cls.__name__: cls for cls in mirrors}
    problems = _both_ways("struct", set(header.structs), set(structs))
    problems += _both_ways("function", set(header.functions), set(signatures))
    for name in sorted(set(header.structs) & set(structs)):
        problems += _check_struct(name, header.structs[name], structs[name], structs)
    for name in sorted(set(header.functions) & set(signatures)):
        problems += _check_function(name, header.functions[name], signatures[name], structs)
    return problems


def layout_probe(header: Header, include: str) -> str:
    """A C program printing each struct's size and each field's offset, as `name size` and
    `name.field offset` lines, for comparison with ctypes' own layout."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{include}"',
             "int main(void) {"]
    for name, fields in header.structs.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'    printf("{name}.{f} %zu\\n", offsetof({name}, {f}));' for f, _ in fields]
    return "\n".join(lines + ["    return 0;", "}", ""])


def ctypes_layout(mirrors) -> dict[str, int]:
    """What `layout_probe` prints, from the ctypes mirrors."""
    layout = {}
    for cls in mirrors:
        layout[cls.__name__] = ctypes.sizeof(cls)
        for field, *_ in cls._fields_:
            layout[f"{cls.__name__}.{field}"] = getattr(cls, field).offset
    return layout
