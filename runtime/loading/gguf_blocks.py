"""A GGUF tensor's quantized blocks read straight into the served block forms, with no float
round trip.

ggml's Q4_1 block (float16 d, float16 m, 16 bytes of nibbles: low nibble = input j, high
nibble = input j + 16; w = q * d + m) is `Int4Weight`'s form field for field; a Q4_0 block
(float16 d, the same nibbles, w = d * (q - 8)) is that form with m = -8 d, which float32
reproduces exactly (q * d and 8 d need at most 15 significant bits); a Q8_0 block (float16 d,
32 int8, w = q * d) is `Int8BlockWeight`'s (runtime/loading/quantization.py). The bytes are
read with numpy structured views of the mapped file and copied once into the contiguous
arrays the kernels read (a block interleaves its scales with its codes; the kernels want them
apart). Other types (F32, F16, BF16, Q5_0, Q5_1, ...) have no block form here: they are
dequantized to float by the caller. The table is where more block types (K-quants) would go.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from runtime.loading.quantization import INT4_GROUP, BlockWeight, Int4Weight, Int8BlockWeight

# ggml type numbers (gguf.GGMLQuantizationType): Q4_0, Q4_1, Q8_0
Q4_0, Q4_1, Q8_0 = 2, 3, 8
_LAYOUTS = {
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (INT4_GROUP // 2,))]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (INT4_GROUP // 2,))]),
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (INT4_GROUP,))]),
}


def has_blocks(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this type and shape is read as a block form (matrices only)."""
    return ggml_type in _LAYOUTS and len(shape) == 2 and shape[1] % INT4_GROUP == 0


def read_blocks(buffer, offset: int, shape: tuple[int, ...], ggml_type: int,
                rows: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> BlockWeight | None:
    """The [N, K] tensor of `ggml_type` at `offset` in `buffer` as its block form, `rows`
    (a reordering of output rows) applied to each array; None where it has no block form
    (or a Q4_0 scale too large for m = -8 d in float16)."""
    if not has_blocks(ggml_type, shape):
        return None
    n, k = shape
    raw = np.frombuffer(buffer, _LAYOUTS[ggml_type], count=n * k // INT4_GROUP, offset=offset)
    raw = raw.reshape(n, k // INT4_GROUP)

    def field(name: str) -> torch.Tensor:  # a contiguous, writable copy of one field
        array = torch.from_numpy(np.ascontiguousarray(raw[name]))
        return rows(array) if rows is not None else array

    if ggml_type == Q8_0:
        return Int8BlockWeight.from_blocks(field("qs"), field("d"))
    d = field("d")
    if ggml_type == Q4_1:
        return Int4Weight.from_blocks(field("qs"), d, field("m"))
    m = (d.float() * -8.0).half()  # exact, short of float16's range
    if not bool(torch.isfinite(m).all()):
        return None
    return Int4Weight.from_blocks(field("qs"), d, m)
