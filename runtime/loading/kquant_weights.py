"""A GGUF file's K-quant matrices (Q4_K, Q5_K, Q6_K) served in the file's own bytes.

Each matrix is held as the file's super-blocks, uint8 [N, K/256, bytes] (256 inputs a block:
144 bytes for Q4_K, 176 for Q5_K, 210 for Q6_K; kernels/cpu/block_ops.c describes the layouts),
without a float copy: the compiled block kernel multiplies float32 activations by them at every
step size (small steps unpack each block in registers, larger ones a panel of rows into a
scratch that stays in L2). The products are the file's exact weights times x: `dequantized()`
equals the `gguf` package's dequantization of the same blocks bit for bit (ggml's formulas and
float32 roundings), and the kernel multiplies by those values, summing in another order.

The classes mirror runtime/loading/quantization.py's `Int4Weight` / `Int8BlockWeight`: `kind`,
`shape`, `exact` (always True: nothing is rounded), `matmul(x, bias)`, `dequantized()` and
`nbytes`; where the compiled kernels are unavailable (or the activations are not float32 on
the CPU) `matmul` is the float matmul of `dequantized()`, the same products, slowly. They are
built from the raw bytes, e.g. a GGUF reader's memory-mapped tensor data: the array is wrapped,
not copied, so the matrix stays resident once (in the file's pages when it is a mapping).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_ops

QK_K = 256  # inputs of a K-quant super-block


class KQuantWeight:
    """W [N, K] as a GGUF file's K-quant super-blocks, uint8 [N, K/256, block_bytes].

    `blocks`: a uint8 numpy array or tensor, [N, K/256, block_bytes] or [N, K/256 *
    block_bytes] (a GGUF tensor's rows as its reader gives them); `shape`, when given, the
    weight's (N, K) to check it against. A contiguous array is used in place (a read-only
    memory map included: nothing writes to it)."""

    kind: ClassVar[str]
    format: ClassVar[int]  # the block kernel's BLOCK_* code: ggml's type number
    block_bytes: ClassVar[int]
    ggml_type: ClassVar[str]  # gguf.GGMLQuantizationType's name
    exact = True  # the file's own weights, always
    d = None  # the scales are inside the blocks (the split forms keep them apart)
    m = None
    error: Any = None  # never approximated (gguf_blocks.py's `Approximation` for those that are)

    def __init__(self, blocks: np.ndarray | torch.Tensor,
                 shape: tuple[int, int] | None = None):
        qs = _as_uint8_tensor(blocks)
        if qs.dim() == 2:
            if qs.shape[1] % self.block_bytes:
                raise ValueError(f"{self.kind}: rows of {qs.shape[1]} bytes are not whole "
                                 f"{self.block_bytes}-byte blocks")
            qs = qs.view(qs.shape[0], qs.shape[1] // self.block_bytes, self.block_bytes)
        if qs.dim() != 3 or qs.shape[2] != self.block_bytes:
            raise ValueError(f"{self.kind} blocks must be [N, K/256, {self.block_bytes}] "
                             f"uint8, not {list(qs.shape)}")
        self.qs = qs
        self.shape = (int(qs.shape[0]), int(qs.shape[1]) * QK_K)
        if shape is not None and tuple(shape) != self.shape:
            raise ValueError(f"{self.kind} blocks {list(qs.shape)} hold a {self.shape} "
                             f"weight, not {tuple(shape)}")

    FIELDS = ("qs",)  # the per-row arrays (quantization.py's block forms name theirs alike)

    @classmethod
    def from_blocks(cls, qs: torch.Tensor) -> Self:
        """The form over `qs` [N, K/256, block_bytes] uint8 as it is."""
        return cls(qs)

    def arrays(self) -> tuple[torch.Tensor, ...]:
        return (self.qs,)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """The same blocks with `fn` (a reordering of output rows, e.g. llama.cpp's Q/K row
        interleave undone) applied: a row's blocks move whole."""
        return type(self)(fn(self.qs))

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """Weights of this form stacked along N (fused q/k/v, gate/up): their blocks stacked."""
        if any(type(p) is not cls for p in parts):
            raise TypeError(f"{cls.__name__}.cat takes {cls.__name__} parts only, not "
                            f"{sorted({type(p).__name__ for p in parts})}")
        return parts[0] if len(parts) == 1 else cls(torch.cat([p.qs for p in parts]))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] times W^T (+ bias [N]): the block kernel on float32 CPU activations,
        else F.linear on `dequantized()`."""
        if kernels.use_cpu_ops(x) and (bias is None or bias.dtype == torch.float32):
            y = cpu_ops.block_linear(x, self.qs, self.format, None, None, bias)
            return y.view(*x.shape[:-1], self.shape[0])
        return F.linear(x, self.dequantized().to(x.dtype), bias)

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [N, K], exactly the file's (gguf's dequantization): for
        references and the fallback path; nothing keeps it."""
        if cpu_ops.available():
            return cpu_ops.block_dequantize(self.qs, self.format)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        n, k = self.shape
        rows = self.qs.reshape(n, -1).numpy()
        w = dequantize(rows, GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 [len(ids), K], exactly `dequantized()[ids]`
        (an embedding lookup: only those rows' blocks are gathered and unpacked)."""
        return type(self)(self.qs.index_select(0, ids.reshape(-1))).dequantized()

    @property
    def nbytes(self) -> int:
        return self.qs.numel()  # what a step reads: the blocks, scales inside

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape})"


class Q4KWeight(KQuantWeight):
    """ggml's block_q4_K: float16 d, dmin, 12 bytes of 6-bit scales and mins for eight
    slices of 32, 128 bytes of nibbles; w = d * sc * q - dmin * m, q in 0..15 (4.5 bits)."""

    kind = "q4_k"
    format = cpu_ops.BLOCK_Q4_K
    block_bytes = cpu_ops.KQUANT_BYTES[cpu_ops.BLOCK_Q4_K]
    ggml_type = "Q4_K"


class Q5KWeight(KQuantWeight):
    """ggml's block_q5_K: Q4_K's fields and 32 bytes of fifth bits, q in 0..31 (5.5 bits)."""

    kind = "q5_k"
    format = cpu_ops.BLOCK_Q5_K
    block_bytes = cpu_ops.KQUANT_BYTES[cpu_ops.BLOCK_Q5_K]
    ggml_type = "Q5_K"


class Q6KWeight(KQuantWeight):
    """ggml's block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one
    per 16 inputs), float16 d; w = d * scale * (q - 32), q in 0..63 (6.5625 bits)."""

    kind = "q6_k"
    format = cpu_ops.BLOCK_Q6_K
    block_bytes = cpu_ops.KQUANT_BYTES[cpu_ops.BLOCK_Q6_K]
    ggml_type = "Q6_K"


class StackedBlocks:
    """A projection whose rows a file holds in different block forms, stacked along N: a
    fused q/k/v of a Q4_K_M file (q and k in Q4_K, v in Q6_K on some layers), or of a file
    whose v is Q8_0 where q and k are not. Each part stays in its own form (a `KQuantWeight`,
    or quantization.py's `Int4Weight` / `Int8BlockWeight`) and is multiplied into its own
    columns of one output; the fused decode layer reads the parts as a chain of matrices
    (kernels/cpu/api.h's Matrix.next). Parts of one form are better joined by that form's
    `cat` (one matrix, one kernel call)."""

    def __init__(self, parts: Sequence):
        if len(parts) < 2 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("StackedBlocks takes two or more parts of one input size, not "
                             f"{[p.shape for p in parts]}")
        self.parts = tuple(parts)
        self.kind = "+".join(p.kind for p in self.parts)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        self.exact = all(p.exact for p in self.parts)
        self.error = None  # the parts say theirs

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (kernels.use_cpu_ops(x) and (bias is None or bias.dtype == torch.float32)):
            return F.linear(x, self.dequantized().to(x.dtype), bias)
        rows = x.reshape(-1, x.shape[-1])
        y = torch.empty(rows.shape[0], self.shape[0], dtype=torch.float32)
        at = 0
        for p in self.parts:
            n = p.shape[0]
            cpu_ops.block_linear(rows, p.qs, cpu_ops.block_format(p), p.d, p.m,
                                 None if bias is None else bias[at:at + n], out=y[:, at:at + n])
            at += n
        return y.view(*x.shape[:-1], self.shape[0])

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32, exactly `dequantized()[ids]` (each from its part)."""
        ids = ids.reshape(-1)
        out = torch.empty(ids.shape[0], self.shape[1], dtype=torch.float32)
        at = 0
        for p in self.parts:
            n = p.shape[0]
            mine = ((ids >= at) & (ids < at + n)).nonzero().squeeze(-1)
            if mine.numel():
                out[mine] = p.rows(ids[mine] - at)
            at += n
        return out

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __repr__(self) -> str:
        return f"StackedBlocks({', '.join(map(repr, self.parts))})"


# by GGUF tensor type name (gguf.GGMLQuantizationType's, e.g. tensor.tensor_type.name)
KQUANT_FORMS: dict[str, type[KQuantWeight]] = {
    cls.ggml_type: cls for cls in (Q4KWeight, Q5KWeight, Q6KWeight)}


def kquant_weight(ggml_type: str, blocks: np.ndarray | torch.Tensor,
                  shape: tuple[int, int] | None = None) -> KQuantWeight:
    """The served form of a GGUF tensor of type `ggml_type` ("Q4_K", "Q5_K" or "Q6_K") from
    its raw bytes; a KeyError names any other type."""
    try:
        form = KQUANT_FORMS[ggml_type]
    except KeyError:
        raise KeyError(f"no K-quant block form for GGUF type {ggml_type!r} (served: "
                       f"{', '.join(KQUANT_FORMS)})") from None
    return form(blocks, shape)


def _as_uint8_tensor(blocks: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 CPU tensor over the same bytes where they already are one."""
    if isinstance(blocks, torch.Tensor):
        t = blocks
    else:
        arr = np.asarray(blocks)
        if arr.dtype != np.uint8:
            raise ValueError(f"K-quant blocks are raw bytes (uint8), not {arr.dtype}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        with warnings.catch_warnings():  # a read-only map: the kernels never write to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    if t.dtype != torch.uint8 or t.device.type != "cpu":
        raise ValueError(f"K-quant blocks are uint8 CPU bytes, not {t.dtype} on {t.device}")
    return t.contiguous()
