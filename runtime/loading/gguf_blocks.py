"""A GGUF tensor's quantized blocks read straight into the served block forms.

Every quantized type a GGUF file may hold for a matrix is served from blocks, none as a float
copy (runtime/models/linear.py runs the block kernels at every step size):

- exactly, in the file's own bytes: Q4_K, Q5_K, Q6_K (runtime/loading/kquant_weights.py: the
  super-blocks as they are, a view of the mapped file unless rows must be reordered);
- exactly, in quantization.py's split forms (the kernels want a block's scales apart from its
  codes, so each field is copied once into a contiguous array): ggml's Q4_1 block (float16 d,
  float16 m, 16 bytes of nibbles: low nibble = input j, high nibble = input j + 16; w = q * d +
  m) is `Int4Weight`'s form field for field; a Q4_0 block (float16 d, the same nibbles, w = d *
  (q - 8)) is that form with m = -8 d, which float32 reproduces exactly (q * d and 8 d need at
  most 15 significant bits); a Q8_0 block (float16 d, 32 int8, w = q * d) is
  `Int8BlockWeight`'s; a Q5_0 block (float16 d, 32 fifth bits, 16 bytes of nibbles, w = d *
  (q - 16)) is `Int8BlockWeight`'s with q - 16 as its int8 codes; an IQ4_NL block (float16 d,
  16 bytes of indices into a table of 16 int8 values, w = d * table[i]) too, with table[i] as
  the codes;
- approximately (`APPROXIMATED`): the types no served form holds exactly are dequantized by
  `gguf` and re-derived in the nearest served form, each block exactly where that form holds it
  (an IQ4_XS block whose d * scale a float16 holds is the Q8 form with its table values as
  codes), else rounded. The form's `error` says by how much (`Approximation`); the start-up log
  reports it per type (runtime/loading/gguf.py `GGUFWeights.approximations`).
Other types (F32, F16, BF16) have no block form: the caller reads them as floats.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.loading.kquant_weights import KQUANT_FORMS, QK_K, KQuantWeight
from runtime.loading.quantization import INT4_GROUP, BlockWeight, Int4Weight, Int8BlockWeight

# ggml type numbers (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
_KQUANTS = {Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
_LAYOUTS = {
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (INT4_GROUP // 2,))]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (INT4_GROUP // 2,))]),
    Q5_0: np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (INT4_GROUP // 2,))]),
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (INT4_GROUP,))]),
    IQ4_NL: np.dtype([("d", "<f2"), ("qs", "u1", (INT4_GROUP // 2,))]),
}
# ggml's kvalues_iq4nl: the 16 int8 values an IQ4_NL / IQ4_XS index selects
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=torch.int8)
# the types served approximately, and the form each is re-derived in: Q5_1's 32 levels per
# block and IQ4_XS's per-32 scales (d * an integer, not always a float16) fit the 8-bit blocks
# (an error of at most half a 1/127 step of the block's largest weight); Q2_K and Q3_K (4 and 8
# levels per 16 inputs, two scales per 32) too: their 4-bit re-derivation rounds by up to
# (max - min) / 30 of a block, several percent of its values, where the 8-bit one stays below
# half a percent (tests/runtime/test_kquant_loading.py measures both)
APPROXIMATED: dict[int, type[Int4Weight] | type[Int8BlockWeight]] = {
    Q5_1: Int8BlockWeight, IQ4_XS: Int8BlockWeight, Q2_K: Int8BlockWeight,
    Q3_K: Int8BlockWeight}
BLOCK_SERVED = frozenset({*_LAYOUTS, *_KQUANTS, *APPROXIMATED})
_BLOCK_INPUTS = {t: (QK_K if t in (*_KQUANTS, IQ4_XS, Q2_K, Q3_K) else INT4_GROUP)
                 for t in BLOCK_SERVED}


@dataclass
class Approximation:
    """How far a served form is from the file's weights (gguf's dequantization): the largest
    absolute difference, and the sums of squares of the differences and of the weights (the
    RMS relative error is sqrt(sq_error / sq_weight); sums, so tensors add up)."""

    ggml_type: str  # the file's type, e.g. "Q3_K"
    max_abs: float
    sq_error: float
    sq_weight: float
    matrices: int = 1

    @classmethod
    def of(cls, ggml_type: str, served: torch.Tensor, exact: torch.Tensor) -> Approximation:
        diff = (served.double() - exact.double())
        return cls(ggml_type, float(diff.abs().max()) if diff.numel() else 0.0,
                   float(diff.pow(2).sum()), float(exact.double().pow(2).sum()))

    def __add__(self, other: Approximation) -> Approximation:
        return Approximation(self.ggml_type, max(self.max_abs, other.max_abs),
                             self.sq_error + other.sq_error, self.sq_weight + other.sq_weight,
                             self.matrices + other.matrices)

    @property
    def rms_relative(self) -> float:
        return (self.sq_error / self.sq_weight) ** 0.5 if self.sq_weight else 0.0


def has_blocks(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this type and shape is read as a block form (matrices only)."""
    return ggml_type in BLOCK_SERVED and len(shape) == 2 \
        and shape[1] % _BLOCK_INPUTS[ggml_type] == 0


def read_blocks(buffer, offset: int, shape: tuple[int, ...], ggml_type: int,
                rows: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> BlockWeight | None:
    """The [N, K] tensor of `ggml_type` at `offset` in `buffer` as its served block form,
    `rows` (a reordering of output rows) applied to each array; None where it has no block
    form (not a matrix, a float type, or a Q4_0 scale too large for m = -8 d in float16).
    An approximated type's form has `exact` False, its `error` (an `Approximation`) and
    `file_weights()`, the file's own weights as float32 (for a float path)."""
    if not has_blocks(ggml_type, shape):
        return None
    n, k = shape
    if ggml_type in _KQUANTS:
        nbytes = KQUANT_FORMS[_KQUANTS[ggml_type]].block_bytes * (n * k // QK_K)
        data = np.frombuffer(buffer, np.uint8, count=nbytes, offset=offset).reshape(n, -1)
        form: KQuantWeight = KQUANT_FORMS[_KQUANTS[ggml_type]](data, (n, k))
        return form.map_rows(rows) if rows is not None else form
    if ggml_type in APPROXIMATED:
        return _approximated(buffer, offset, (n, k), ggml_type, rows)
    raw: Any = np.frombuffer(buffer, _LAYOUTS[ggml_type], count=n * k // INT4_GROUP,
                             offset=offset).reshape(n, k // INT4_GROUP)

    def field(name: str) -> torch.Tensor:  # a contiguous, writable copy of one field
        array = torch.from_numpy(np.ascontiguousarray(raw[name]))
        return rows(array) if rows is not None else array

    if ggml_type == Q8_0:
        return Int8BlockWeight.from_blocks(field("qs"), field("d"))
    if ggml_type in (Q5_0, IQ4_NL):
        nibbles = field("qs")
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # input j, then j + 16
        if ggml_type == IQ4_NL:
            return Int8BlockWeight.from_blocks(IQ4_VALUES[codes.long()], field("d"))
        bits = (field("qh").to(torch.int64)[..., None] >> torch.arange(INT4_GROUP)) & 1
        q = (codes.to(torch.int16) | (bits.to(torch.int16) << 4)) - 16
        return Int8BlockWeight.from_blocks(q.to(torch.int8), field("d"))
    d = field("d")
    if ggml_type == Q4_1:
        return Int4Weight.from_blocks(field("qs"), d, field("m"))
    m = (d.float() * -8.0).half()  # exact, short of float16's range
    if not bool(torch.isfinite(m).all()):
        return None
    return Int4Weight.from_blocks(field("qs"), d, m)


def dequantize_file(buffer, offset: int, shape: tuple[int, int], ggml_type: int
                    ) -> torch.Tensor:
    """gguf's own dequantization of the [N, K] tensor at `offset`: float32 [N, K]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(ggml_type)
    block, size = GGML_QUANT_SIZES[kind]
    n, k = shape
    raw = np.frombuffer(buffer, np.uint8, count=n * k // block * size, offset=offset)
    w = dequantize(raw.reshape(n, -1), kind).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def _approximated(buffer, offset: int, shape: tuple[int, int], ggml_type: int,
                  rows: Callable[[torch.Tensor], torch.Tensor] | None) -> BlockWeight:
    exact = exact_weights(buffer, offset, shape, ggml_type, rows)
    served: Int4Weight | Int8BlockWeight
    if ggml_type == IQ4_XS:
        served = _iq4_xs_blocks(buffer, offset, shape, exact, rows)
    else:
        served = APPROXIMATED[ggml_type](exact)
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(ggml_type).name
    served.error = Approximation.of(name, served.dequantized(), exact)
    # the file's own weights, for a caller that serves floats (nothing keeps them)
    served.file_weights = lambda: exact_weights(buffer, offset, shape, ggml_type, rows)
    return served


def exact_weights(buffer, offset: int, shape: tuple[int, int], ggml_type: int,
                  rows: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    exact = dequantize_file(buffer, offset, shape, ggml_type)
    return rows(exact) if rows is not None else exact


_IQ4_XS = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", (4,)),
                    ("qs", "u1", (QK_K // 2,))])


def _iq4_xs_blocks(buffer, offset: int, shape: tuple[int, int], w: torch.Tensor,
                   rows: Callable[[torch.Tensor], torch.Tensor] | None) -> Int8BlockWeight:
    """IQ4_XS weights (dl = d * (scale - 32) per 32 inputs, times a table value) in the 8-bit
    block form: a block whose dl a float16 holds keeps its table values as codes (exactly),
    any other is re-derived from its largest weight (d = max |w| / 127, `Int8BlockWeight`)."""
    n, k = shape
    raw = np.frombuffer(buffer, _IQ4_XS, count=n * k // QK_K, offset=offset).reshape(n, -1)

    def field(name: str) -> torch.Tensor:
        array = torch.from_numpy(np.ascontiguousarray(raw[name]).astype(
            np.int64 if name != "d" else np.float32))
        return rows(array) if rows is not None else array

    sub = torch.arange(QK_K // INT4_GROUP)
    low = (field("scales_l")[..., sub // 2] >> (4 * (sub % 2))) & 15
    high = (field("scales_h")[..., None] >> (2 * sub)) & 3
    dl = (field("d")[..., None] * ((low | (high << 4)) - 32).float()).reshape(n, -1)
    nibbles = field("qs").view(n, -1, 16)  # [N, K/32, 16]: input j low, j + 16 high
    codes = IQ4_VALUES[torch.cat([nibbles & 15, nibbles >> 4], dim=-1)]
    rounded = Int8BlockWeight(w)
    keep = dl.half().float() == dl
    d = torch.where(keep, dl.half(), rounded.d)
    q = torch.where(keep[..., None], codes, rounded.qs)
    served = Int8BlockWeight.from_blocks(q, d)
    served.exact = bool(torch.equal(served.dequantized(), w))
    return served
