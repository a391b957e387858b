"""Read a GGUF file: model config, weights under Hugging Face names, tokenizer.

The header (metadata, tokenizer, tensor directory) is parsed from the mapped file; the tensors
are read when the model asks for them (`GGUFWeights`): quantized matrices (Q4_0, Q4_1, Q5_0,
Q8_0, the K-quants, IQ4_NL exactly; Q5_1, Q2_K, Q3_K, IQ4_XS approximately, the error
reported) straight into the block forms the CPU kernels serve (runtime/loading/gguf_blocks.py),
anything else dequantized to float32 by gguf's own dequantizers.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.tokenizer import Tokenizer
from runtime.loading.gguf_arch import (  # noqa: F401 - the names callers know from here
    ARCHITECTURES,
    PERMUTED_ARCHITECTURES,
    config_from_metadata,
    hf_name,
)

if TYPE_CHECKING:  # the block forms import the kernels; a tokenizer-only read needs neither
    from runtime.loading.quantization import BlockWeight



def open_gguf(path: str) -> tuple[ModelConfig, GGUFWeights, Tokenizer]:
    """Config, weights (read from the mapped file when asked, see `GGUFWeights`) and tokenizer
    of a GGUF file. Reads the header only: no tensor data yet."""
    meta, tensors = read_header(path)
    with _errors_named(path):
        by_name = {t.name: t for t in tensors}
        config = config_from_metadata(meta, by_name, _rope_factors(path, by_name))
        tokenizer = Tokenizer.from_gguf_metadata(_tokenizer_metadata(meta))
        weights = GGUFWeights(path, tensors, config)
    return config, weights, tokenizer


def _rope_factors(path: str, tensors: dict) -> tuple[float, ...]:
    """The `rope_freqs.weight` tensor's values (Llama 3.1's files), () where there is none."""
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return ()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return tuple(float(v) for v in _dequantize(mm, info, path).reshape(-1).tolist())


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, dequantized float32 weights (HF names and layout) and tokenizer of a GGUF file."""
    config, weights, tokenizer = open_gguf(path)
    return config, dict(weights.items()), tokenizer


def read_gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads the header, not the weights)."""
    meta, _ = read_header(path)
    with _errors_named(path):
        return Tokenizer.from_gguf_metadata(_tokenizer_metadata(meta))


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by Hugging Face name, read from the mapped file when asked and
    not kept: `weights[name]` is float32 in HF layout (what `read_gguf` returns: gguf's
    dequantization, exactly), and `blocks(name)` a quantized matrix in its served block form
    (runtime/loading/gguf_blocks.py), None for float types. Both undo llama.cpp's Q/K row
    interleave. A type served approximately has its error on the form (`error`). The model
    takes each tensor once, in the form it serves, so nothing is held twice and no float copy
    is made only to re-derive the blocks from it."""

    def __init__(self, path: str, tensors: list[TensorInfo], config: ModelConfig):
        self.path, self.config = path, config
        self.infos = {hf_name(t.name, path, config.architecture): t for t in tensors}
        supported = {int(k) for k in supported_types()}
        for t in tensors:  # refuse at load, naming the tensor, not at the first use
            if t.ggml_type not in supported:
                raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type "
                                     f"{_type_name(t.ggml_type)} (supported: "
                                     f"{', '.join(sorted(k.name for k in supported_types()))})")
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __getitem__(self, name: str) -> torch.Tensor:
        from runtime.loading.gguf_blocks import APPROXIMATED

        t = self.infos[name]
        blocks = None if t.ggml_type in APPROXIMATED else self.blocks(name)
        if blocks is not None:  # the same float32 values as gguf's dequantizer, faster
            return blocks.dequantized()
        tensor = _unpermute(t.name, _dequantize(self._mm, t, self.path), self.config)
        self._release(t)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self.infos  # Mapping's own would read the tensor to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def blocks(self, name: str) -> BlockWeight | None:
        from runtime.loading.gguf_blocks import read_blocks

        t = self.infos[name]
        form = read_blocks(self._mm, t.offset, t.shape, t.ggml_type,
                           lambda rows: _unpermute(t.name, rows, self.config))
        self._release(t)
        return form

    def _release(self, t: TensorInfo) -> None:
        """Take the tensor's file pages out of this process's resident set once it is read.
        Most forms copy their fields out of the file's interleaved blocks (Q4_0's scale and
        nibbles apart; rows reordered): the pages those copies were read from would otherwise
        stay mapped and counted, doubling a worker's resident size (3B in Q4_0: 4.2 GiB where
        the file is 1.6). A form that keeps a view of the file (the K-quants) faults its pages
        back in from the page cache at first use: always correct, never a disk read twice."""
        page = mmap.PAGESIZE
        start = t.offset // page * page
        end = min(-(-(t.offset + t.nbytes) // page) * page, len(self._mm))
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def type_counts(self) -> dict[str, int]:
        """Tensors per GGUF type, most first (for the loading line)."""
        counts: dict[str, int] = {}
        for t in self.infos.values():
            name = _type_name(t.ggml_type)
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


@contextmanager
def _errors_named(path: str):
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
    with f, _errors_named(path):
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


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def supported_types() -> set:
    """The tensor types read: the float ones, and every block type with a served form
    (runtime/loading/gguf_blocks.py; any other is refused at load, by name)."""
    from gguf import GGMLQuantizationType as Q

    from runtime.loading.gguf_blocks import BLOCK_SERVED

    return {Q.F32, Q.F16, Q.BF16, *(Q(t) for t in BLOCK_SERVED)}


def _dequantize(mm, t: TensorInfo, path: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(t.ggml_type)
    if kind not in supported_types():
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {kind.name}")
    raw = np.frombuffer(mm, np.uint8, count=t.nbytes, offset=t.offset)
    rows = raw.reshape(-1, t.nbytes // math.prod(t.shape[:-1]))  # one row per output row
    array = dequantize(rows, kind).reshape(t.shape)
    # F32 data is a read-only view of the mapped file; np.require copies only then
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _unpermute(name: str, w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave so rotate_half RoPE (HF layout) applies."""
    if config.architecture not in PERMUTED_ARCHITECTURES:
        return w
    if ".attn_q." in name:
        heads = config.num_attention_heads
    elif ".attn_k." in name:
        heads = config.num_key_value_heads
    else:
        return w
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())


def _tokenizer_metadata(meta: dict) -> dict:
    prefix = "tokenizer.ggml."
    out = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}
    out["chat_template"] = meta.get("tokenizer.chat_template")
    return out
