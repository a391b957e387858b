"""Weight-only quantized formats for the CPU and the `--quantization` choice.

int8 holds a weight with one scale per output row; the compiled CPU kernels (kernels/cpu/)
multiply it on float32 activations, torch's `_weight_int8pack_mm` on bfloat16 ones where they
are missing. The scales are rounded to bfloat16 and `dequantized()` uses the same values, so
the float copy the runtime keeps for large batches (runtime/models/linear.py) holds exactly the
weights the kernel multiplies by.

int4 serves a GGUF's own blocks, at every step size and without a float copy
(runtime/models/linear.py): `Int4Weight` (a Q4_1 block's form: per 32 inputs, 16 bytes of
nibbles and float16 d, m; w = q * d + m; Q4_0 blocks fit it too), `Int8BlockWeight` (a Q8_0
block's: 32 int8 and a float16 d; Q5_0 and IQ4_NL blocks fit it too) and the K-quants' super-
blocks (runtime/loading/kquant_weights.py), multiplied by the compiled kernel
(kernels/cpu/block_ops.c) on float32 activations. A GGUF's matrices arrive in these forms
straight from the file (runtime/loading/gguf_blocks.py, which also re-derives the types no
form holds exactly, reporting the error); a float weight takes a block form only where the
form holds it exactly (the constructors re-derive it), so the model multiplies by the file's
own weights at every batch size.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import torch

import kernels
from contract.config import QUANTIZATIONS
from contract.errors import RuntimeErrorBase

INT4_GROUP = 32
_DEQUANTIZE_FLOATS = 1 << 18  # output values per step of `dequantized` (1 MiB: in L2)
# the weight-only kernels need a vectorized CPU build: AVX2, AVX-512 (plain "DEFAULT" is scalar)
_FAST_CPU = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX")


class QuantizationError(RuntimeErrorBase, ValueError):
    """A `--quantization` value the model or the device cannot take."""


def resolve(requested: str, weight_format: str, device: str) -> str:
    """The format to serve: `none`, `int8` or `int4`.

    `auto` quantizes only what was quantized already (a GGUF whose matrices are mostly Q4/Q5/
    Q8, K-quant or IQ4 blocks: `weight_format`, the file's dominant type), only on a CPU whose
    torch build has vectorized kernels: int4, which means "serve the file's own blocks" (every
    matrix in its block form at every step size: runtime/loading/gguf_blocks.py), where the
    compiled kernels run, else int8. A float checkpoint stays float unless asked: quantizing
    it would change its outputs without being told to.
    """
    if requested not in QUANTIZATIONS:  # EngineConfig refuses them too; direct callers here
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                f"not {requested!r}")
    if requested == "auto":
        quantized_file = weight_format.startswith(("Q", "IQ"))
        fast = torch.backends.cpu.get_cpu_capability() in _FAST_CPU
        if not (quantized_file and fast and device == "cpu"):
            return "none"
        return "int4" if kernels.cpu_ops_take(torch.float32) else "int8"
    if requested != "none" and device != "cpu":
        raise QuantizationError(f"quantization {requested} runs on the CPU only (device "
                                f"{device}); use --quantization none")
    return requested


class Int8Weight:
    """W [N, K] as int8 with one bfloat16 scale per row (symmetric, -127..127)."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor):
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
        self.q = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.float()  # the bfloat16 values, held as float32 for the C GEMM
        self.shape = tuple(weight.shape)
        # the C kernels' layout for larger steps; without them nothing reads it
        self.panels = kernels.cpu_ops.pack_panels(self.q) if kernels.cpu_ops.available() \
            else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.int8_matmul(x, self.q, self.scale, bias, self.panels)

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4  # what a step reads: q or its panels


class _Blocks:
    """What both block forms share: blocks of 32 inputs along K, and the compiled kernel."""

    kind: str
    bits: int
    shape: tuple[int, int]
    exact: bool
    FIELDS: tuple[str, ...]  # the per-row arrays, `qs` first
    # for a type served approximately (gguf_blocks.py): how far from the file's weights (an
    # `Approximation`), and the file's own weights as float32, for a float path
    error: Any = None
    file_weights: Callable[[], torch.Tensor] | None = None

    def _blocks(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as [N, K / 32, 32] float32 blocks (and the shape noted)."""
        n, k = weight.shape
        if k % INT4_GROUP:
            raise QuantizationError(f"{self.kind} needs input sizes divisible by "
                                    f"{INT4_GROUP}, not {k}")
        self.shape = (n, k)
        return weight.float().view(n, k // INT4_GROUP, INT4_GROUP)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.block_matmul(x, self, bias)

    def dequantized(self) -> torch.Tensor:
        """The weights as float32 [N, K]: exactly the values the kernel multiplies by, and
        those of gguf's dequantizers. Computed a few rows at a time into the result, so the
        temporaries (codes, products) stay in the CPU's cache instead of each taking fresh
        pages (SmolLM2's 513 MiB: 0.21-0.26 s on one thread, against 0.22-0.44 s as one
        whole-matrix expression)."""
        n, k = self.shape
        out = torch.empty(n, k // INT4_GROUP, INT4_GROUP)
        step = max(1, _DEQUANTIZE_FLOATS // k)
        for r in range(0, n, step):
            self._dequantize_rows(slice(r, r + step), out[r:r + step])
        return out.view(n, k)

    def _dequantize_rows(self, rows: slice, out: torch.Tensor) -> None:
        raise NotImplementedError

    @classmethod
    def _from_arrays(cls, arrays: Sequence[torch.Tensor]) -> Self:
        """The form holding `arrays` (in `FIELDS` order, rows first) as they are: a file's own
        blocks, exact by definition."""
        self = cls.__new__(cls)
        for name, array in zip(cls.FIELDS, arrays, strict=True):
            setattr(self, name, array.contiguous())
        qs = arrays[0]
        self.shape = (qs.shape[0], qs.shape[1] * INT4_GROUP)
        self.exact = True
        return self

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 [len(ids), K], exactly `dequantized()[ids]`
        (an embedding lookup: only those rows' blocks are gathered and unpacked)."""
        ids = ids.reshape(-1)
        return self._from_arrays([a.index_select(0, ids) for a in self.arrays()]).dequantized()

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """The per-row arrays of the form, in `FIELDS` order."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """Weights stacked along N (fused q/k/v, gate/up): their blocks stacked, nothing
        re-derived. Every part has this form."""
        if len(parts) == 1:
            return parts[0]
        return cls._from_arrays([torch.cat(rows) for rows in zip(*(p.arrays() for p in parts))])


class Int4Weight(_Blocks):
    """W [N, K] in blocks of 32 inputs, w = q * d + m with q in 0..15 and float16 d, m per
    block: a GGUF Q4_1 block's own form (16 bytes of nibbles, two float16 numbers), read by
    the compiled CPU kernel (kernels/cpu/block_ops.c) on float32 activations.

    Built from float weights by taking each block's min as m and (max - min) / 15 as d: for a
    file's Q4_1 matrix (llama.cpp's quantizer uses both 0 and 15 in every block) that recovers
    the file's q, d and m exactly. A Q4_0 block (d * (q - 8)) is recovered from its largest
    weight instead. `exact` says whether every block was: the kernel then multiplies by the
    file's own weights. Anything else is rounded to 4 bits (`exact` False)."""

    kind = "int4"
    bits = 4
    FIELDS = ("qs", "d", "m")

    def __init__(self, weight: torch.Tensor):
        g = self._blocks(weight)
        # Q4_1 blocks span min..max in 15 steps; Q4_0 blocks are d * (q - 8) with the largest
        # |w| at q = 0, i.e. m = that weight and d = -m / 8. Each block takes the first form
        # that reproduces it exactly, else the min..max rounding.
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        top = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        d1, m1 = ((hi - lo) / 15.0).half(), lo.half()
        d0, m0 = (-top / 8.0).half(), top.half()
        q1, fits1 = self._codes(g, d1, m1)
        q0, fits0 = self._codes(g, d0, m0)
        use0 = fits0 & ~fits1
        self.d, self.m = torch.where(use0, d0, d1), torch.where(use0, m0, m1)
        q = torch.where(use0[..., None], q0, q1)
        self.exact = bool((fits1 | fits0).all())
        # byte j of a block: input j in the low nibble, input j + 16 in the high one
        self.qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()

    @classmethod
    def from_blocks(cls, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4Weight:
        """The form from a file's blocks as they are: `qs` [N, K / 32, 16] uint8 (byte j:
        input j in the low nibble, j + 16 in the high one), `d`, `m` [N, K / 32] float16."""
        return cls._from_arrays((qs, d, m))

    @staticmethod
    def _codes(g: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor):
        """The nearest codes of each block under (d, m), and which blocks they reproduce."""
        d, m = d16.float()[..., None], m16.float()[..., None]
        q = ((g - m) / torch.where(d != 0, d, 1.0)).round().clamp(0, 15).to(torch.uint8)
        return q, (q * d + m == g).all(dim=-1)

    def codes(self) -> torch.Tensor:
        """The 4-bit values, [N, K / 32, 32] in input order."""
        return torch.cat([self.qs & 15, self.qs >> 4], dim=-1)

    def _dequantize_rows(self, rows: slice, out: torch.Tensor) -> None:
        qs = self.qs[rows]
        codes = torch.empty(*qs.shape[:2], 2, INT4_GROUP // 2, dtype=torch.uint8)
        torch.bitwise_and(qs, 15, out=codes[:, :, 0])
        torch.bitwise_right_shift(qs, 4, out=codes[:, :, 1])
        out.copy_(codes.view(out.shape))
        # q * d, then + m: two roundings, as gguf's `d * q + m` (q * d is exact anyway)
        out.mul_(self.d[rows].float()[..., None]).add_(self.m[rows].float()[..., None])

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * (self.d.numel() + self.m.numel())


class Int8BlockWeight(_Blocks):
    """W [N, K] in blocks of 32 inputs, w = q * d with q in -127..127 and a float16 d per block:
    a GGUF Q8_0 block's own form (32 bytes and one float16 number), read by the same compiled
    kernel as `Int4Weight` (kernels/cpu/block_ops.c).

    Built from float weights with d = max |w| / 127 per block: llama.cpp's Q8_0 quantizer puts
    the block's largest |w| at q = +-127, so a file's Q8_0 matrix comes back exactly (`exact`),
    where the per-row `Int8Weight` would round it again."""

    kind = "int8-block"
    bits = 8
    FIELDS = ("qs", "d")
    m = None  # symmetric: no per-block offset

    def __init__(self, weight: torch.Tensor):
        g = self._blocks(weight)
        self.d = (g.abs().amax(dim=-1) / 127.0).half()
        d = self.d.float()[..., None]
        self.qs = (g / torch.where(d != 0, d, 1.0)).round().clamp(-127, 127).to(torch.int8) \
            .contiguous()
        self.exact = bool(torch.equal(self.qs * d, g))

    @classmethod
    def from_blocks(cls, qs: torch.Tensor, d: torch.Tensor) -> Int8BlockWeight:
        """The form from a file's Q8_0 blocks as they are: `qs` [N, K / 32, 32] int8, `d`
        [N, K / 32] float16."""
        return cls._from_arrays((qs, d))

    def _dequantize_rows(self, rows: slice, out: torch.Tensor) -> None:
        out.copy_(self.qs[rows])
        out.mul_(self.d[rows].float()[..., None])

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * self.d.numel()


# a GGUF file's blocks in a form the block kernels run: the split forms above, a K-quant's
# super-blocks (kquant_weights.py), or a fused projection's parts of several forms stacked
from runtime.loading.kquant_weights import KQuantWeight, StackedBlocks  # noqa: E402

BlockWeight = Int4Weight | Int8BlockWeight | KQuantWeight | StackedBlocks


def quantize(weight: torch.Tensor, kind: str) -> Int8Weight | Int4Weight:
    return Int8Weight(weight) if kind == "int8" else Int4Weight(weight)
