"""Weight-only quantized formats for the CPU and the `--quantization` choice.

A quantized weight is held as int8 (one scale per output row) or int4 (groups of 32 along the
input, a scale and a zero point per group) and multiplied by torch's own CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) on bfloat16 activations: a batch-1
decode reads a quarter (an eighth) of the float32 bytes. The kernels take bfloat16 scales, so
`dequantized()` rounds the scales the same way: the float copy the runtime keeps for large
batches (runtime/linear.py) holds exactly the values the kernel multiplies by, and the two paths
differ only by the activations' bfloat16 rounding.

int4 groups are asymmetric, min to max in 15 steps: a GGUF Q4_1 block is exactly that (its
minimum and d = (max - min) / 15), so requantizing Q4_1 weights recovers the file's own 4-bit
values and only the scales' rounding to bfloat16 is new.
"""
from __future__ import annotations

import torch

import kernels
from runtime.errors import RuntimeErrorBase

CHOICES = ("auto", "none", "int8", "int4")
INT4_GROUP = 32
# the weight-only kernels need a vectorized CPU build: AVX2, AVX-512 (plain "DEFAULT" is scalar)
_FAST_CPU = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX")


class QuantizationError(RuntimeErrorBase, ValueError):
    """A `--quantization` value the model or the device cannot take."""


def resolve(requested: str, weight_format: str, device: str) -> str:
    """The format to serve: `none`, `int8` or `int4`.

    `auto` quantizes only what was quantized already (a GGUF with Q4/Q5/Q8 weights), only on a
    CPU whose torch build has vectorized kernels, and picks int8: on the machines measured
    (docs/perf.md) int8 beat int4 at every batch size. A float checkpoint stays float unless
    asked: quantizing it would change its outputs without being told to.
    """
    if requested not in CHOICES:
        raise QuantizationError(f"quantization must be one of {', '.join(CHOICES)}, "
                                f"not {requested!r}")
    if requested == "auto":
        quantized_file = weight_format.startswith("Q")
        fast = torch.backends.cpu.get_cpu_capability() in _FAST_CPU
        return "int8" if quantized_file and fast and device == "cpu" else "none"
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


class Int4Weight:
    """W [N, K] in groups of 32 inputs: q in 0..15, w = (q - 8) * scale + zero (torch's CPU
    int4 convention), scale and zero in bfloat16."""

    kind = "int4"

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        if k % INT4_GROUP:
            raise QuantizationError(f"int4 needs input sizes divisible by {INT4_GROUP}, "
                                    f"not {k}")
        g = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k).contiguous(), 1)
        zero = lo + 8.0 * scale  # (q - 8) * scale + zero == q * scale + lo
        # [K / group, N, 2]: the kernel's layout of scales and zero points
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16) \
            .contiguous()
        self.q = q.to(torch.uint8)  # kept for dequantized(); half a byte more per weight
        self.shape = (n, k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, INT4_GROUP,
                                              self.scales_zeros).to(x.dtype)
        return y if bias is None else y + bias

    def dequantized(self) -> torch.Tensor:
        n, k = self.shape
        sz = self.scales_zeros.float()
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [N, K / group]
        w = (self.q.float() - 8.0) * scale[..., None] + zero[..., None]
        return w.view(n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


def quantize(weight: torch.Tensor, kind: str) -> Int8Weight | Int4Weight:
    return Int8Weight(weight) if kind == "int8" else Int4Weight(weight)
