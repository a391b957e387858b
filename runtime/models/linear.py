"""A linear layer that picks its kernel by the number of rows in the step.

Weight-only quantized kernels win when a step is small (a batch-1 decode reads the weights
once and does little arithmetic on them) and lose when it is large (dequantizing inside the
kernel costs more than float32 GEMM's arithmetic saves): measured on the 2-core machines,
int8 ran a 576x49152 projection in 0.4x the time of float32 at 1 row and 1.7x at 64. So a
quantized layer keeps both: the packed weight for steps of at most `max_quant_rows` rows and
its exact float dequantization for larger ones (runtime/loading/quantization.py explains why the two
agree up to the activations' rounding). The crossover is measured per weight shape at start
(runtime/loading/calibration.py), once every weight is loaded (runtime/models/llama.py sets it).

With int4, a weight keeps the block form the GGUF file holds it in instead (`small`,
runtime/loading/quantization.py: 4-bit `Int4Weight` or 8-bit `Int8BlockWeight`) for steps of up to
`max_small_rows` rows, and its float copy is the file's own weights: every batch size
multiplies by the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.loading.quantization import BlockWeight, Int8Weight


class Linear:
    __slots__ = ("weight", "bias", "packed", "max_quant_rows", "small", "max_small_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: Int8Weight | None = None, max_quant_rows: int = 0,
                 small: BlockWeight | None = None, max_small_rows: int = 0):
        self.weight = weight  # float, [N, K]: the large-step path (and the reference)
        self.bias = bias
        self.packed = packed
        self.max_quant_rows = max_quant_rows if packed is not None else 0
        self.small = small
        self.max_small_rows = max_small_rows if small is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.max_small_rows:
            assert self.small is not None
            return self.small.matmul(x, self.bias)
        if rows <= self.max_quant_rows:
            assert self.packed is not None
            return self.packed.matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]
