"""A GGUF file's header read from the mapped file: its metadata as plain Python values and its
tensor directory (`TensorInfo`: name, torch-order shape, type, absolute offset, bytes), checked
against the file's size. Our own parser: gguf.GGUFReader builds a numpy view per vocabulary
string and takes seconds on a 49k-token vocabulary; this takes a few hundredths."""
from __future__ import annotations

import math
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from contract.errors import ModelLoadError


@contextmanager
def errors_named(path: str):
    """Every error as a ModelLoadError naming the file (bad files raise KeyError, ValueError...)."""
    try:
        yield
    except ModelLoadError as e:
        if path in str(e):
            raise
        raise ModelLoadError(f"{path}: {e}") from e
    except Exception as e:
        raise ModelLoadError(f"{path}: malformed GGUF: {type(e).__name__}: {e}") from e


def read_header(path: str) -> tuple[dict, list[TensorInfo]]:
    """Metadata (plain Python values) and tensor directory of a GGUF file, checked against its size.

    Our own parser over the mapped file: gguf.GGUFReader builds a numpy view per vocabulary
    string and takes seconds on a 49k-token vocabulary; this takes a few hundredths.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - entered just below, once the open has succeeded
    except OSError as e:
        raise ModelLoadError(f"{path}: unreadable: {e}") from e
    with f, errors_named(path):
        size = os.fstat(f.fileno()).st_size
        if size < 4:  # mmap refuses an empty file
            raise ModelLoadError("truncated: header ends early")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cursor = _Cursor(mm, size)
            meta, tensors = _parse_header(cursor)
        align = int(meta.get("general.alignment", 32))
        data_start = (cursor.pos + align - 1) // align * align  # tensor data is aligned
    for t in tensors:
        t.offset += data_start
        if t.offset + t.nbytes > size:
            raise ModelLoadError(f"{path}: truncated: tensor {t.name} ends past the end of file")
    return meta, tensors


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores the fastest dim first)
    ggml_type: int
    offset: int  # absolute in the file once read_header returns
    nbytes: int


_SCALARS = {k: struct.Struct(v) for k, v in {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d"}.items()}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = _SCALARS[10]
_MAX_STRING = 1 << 30


class _Cursor:
    """Sequential little-endian reads over a mapped file; every read checked against its size
    (which also stops absurd lengths from a corrupt header)."""

    def __init__(self, mm, size: int):
        self.mm, self.size, self.pos = mm, size, 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise ModelLoadError("truncated: header ends early")
        data = self.mm[self.pos:end]
        self.pos = end
        return data

    def scalar(self, kind: int):
        unpack = _SCALARS.get(kind)
        if unpack is None:
            raise ModelLoadError(f"bad metadata value type {kind}")
        if self.pos + unpack.size > self.size:
            raise ModelLoadError("truncated: header ends early")
        value = unpack.unpack_from(self.mm, self.pos)[0]
        self.pos += unpack.size
        return value

    def string(self) -> str:
        n = self.scalar(10)
        if n > _MAX_STRING:
            raise ModelLoadError("bad string length")
        return self.take(n).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop: a vocabulary is most of a header."""
        mm, pos, size = self.mm, self.pos, self.size
        out: list[str] = []
        append, length = out.append, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise ModelLoadError("truncated: header ends early")
            n = length(mm, pos)[0]
            pos += 8
            if n > _MAX_STRING or pos + n > size:
                raise ModelLoadError("truncated: header ends early" if n <= _MAX_STRING
                                     else "bad string length")
            append(mm[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if item in _NUMPY:  # numbers in one go
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
        if item == _STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]


def _parse_header(c: _Cursor) -> tuple[dict, list[TensorInfo]]:
    if c.take(4) != b"GGUF":
        raise ModelLoadError("not a GGUF file (bad magic)")
    version = c.scalar(4)
    if version not in (2, 3):
        raise ModelLoadError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = c.scalar(10), c.scalar(10)
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.scalar(4))
    return meta, [_tensor_info(c) for _ in range(n_tensors)]


def _tensor_info(c: _Cursor) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = c.string()
    dims = [c.scalar(10) for _ in range(c.scalar(4))]
    kind, offset = c.scalar(4), c.scalar(10)
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ModelLoadError(f"tensor {name} has unknown type {kind}") from None
    count = math.prod(dims)
    return TensorInfo(name, tuple(reversed(dims)), kind, offset, count // block * type_size)
