"""A linear layer in its served form, resident once.

A GGUF's quantized matrices are served as the file's blocks (`small`: runtime/loading/
quantization.py's `Int4Weight` / `Int8BlockWeight`, runtime/loading/kquant_weights.py's
K-quants, or a fused projection's parts of several forms stacked) at every step size: the
compiled block kernel unpacks each weight in registers for small steps and a panel of rows
into a per-thread scratch for many tokens (kernels/cpu/block_ops.c), so no float copy of the
matrix is kept (issue 31: the copies made a worker five times the file's size). Every batch
size multiplies by the file's own weights.

An int8 per-row weight (a float checkpoint quantized on request, `packed`) keeps its float
copy: its kernel (kernels/cpu/decode_ops.c) runs any step size but measured 1.6-1.8x float32
GEMM's time from 128 tokens up on the 2-core machines, so steps above a measured crossover
(runtime/loading/calibration.py) run the float copy; the copy holds exactly the int8 weights
(quantization.py explains why the two agree up to the activations' rounding). A float
checkpoint served as float is its one float copy. A step of up to SMALL_STEP_ROWS rows (a
decode batch, or one stream's k + 1 verification rows under speculation) takes the quantized
kernel wherever a one-row step does, whatever the crossover measured: such a step is bound by
the bytes it reads, so reading the float copy (four times the int8 bytes) cannot win there, and
a crossover measured low while the machine was busy must not send verification to it.

`weight` is the float weight where one is held; for a block-served Linear it is a tensor
without storage (`BlockRows`) whose embedding lookup gathers rows from the blocks and whose
other uses dequantize the weight for that call only, so code that reads `weight` (the tied
embedding, byte counts) keeps working without a resident copy.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from runtime.loading.quantization import BlockWeight, Int8Weight

# rows a step may have and still take the quantized kernel wherever a one-row step does: a
# verification step of one stream (num_spec_tokens + 1) or a few speculating streams' rows
SMALL_STEP_ROWS = 16


class Linear:
    __slots__ = ("_weight", "bias", "packed", "max_quant_rows", "small", "max_small_rows",
                 "shape")

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 packed: Int8Weight | None = None, max_quant_rows: int = 0,
                 small: BlockWeight | None = None, max_small_rows: int = 0):
        if weight is None and small is None:
            raise ValueError("a Linear needs a float weight or a block form")
        self._weight = weight  # float [N, K]: an int8 weight's large steps; None: blocks only
        self.bias = bias
        self.packed = packed
        self.max_quant_rows = max_quant_rows if packed is not None else 0
        self.small = small
        # without a float copy the blocks run every step size
        self.max_small_rows = (max_small_rows if weight is not None else 1 << 62) \
            if small is not None else 0
        self.shape: tuple[int, int] = tuple(
            small.shape if small is not None else weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x.shape[0])
        if path == "small":
            assert self.small is not None
            return self.small.matmul(x, self.bias)
        if path == "packed":
            assert self.packed is not None
            return self.packed.matmul(x, self.bias)
        return F.linear(x, self._weight, self.bias)

    def path(self, rows: int) -> str:
        """The form a step of `rows` rows multiplies by: "small" (the blocks), "packed" (int8)
        or "float". A limit of 0 means the form never runs (a one-row step measured faster on
        the float copy): then small steps stay with the one-row step's choice too."""
        small, quant = self.max_small_rows, self.max_quant_rows
        if rows <= small or (small and rows <= SMALL_STEP_ROWS):
            return "small"
        if rows <= quant or (quant and rows <= SMALL_STEP_ROWS):
            return "packed"
        return "float"

    @property
    def weight(self) -> torch.Tensor:
        """The float weight [N, K]: the one held, else a storage-less view of the blocks
        (`BlockRows`)."""
        if self._weight is not None:
            return self._weight
        assert self.small is not None
        return BlockRows(self.small)

    @property
    def dense(self) -> torch.Tensor | None:
        """The float copy held, or None (a block weight served alone)."""
        return self._weight

    @property
    def float_bytes(self) -> int:
        """Bytes of the float copy this Linear keeps (0: blocks only)."""
        w = self._weight
        return 0 if w is None else w.numel() * w.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float [len(ids), K] (a tied embedding's lookup): gathered
        from the blocks where no float copy is held, exactly `dequantized()[ids]`."""
        if self._weight is not None:
            return F.embedding(ids, self._weight)
        assert self.small is not None
        return self.small.rows(ids)


class BlockRows(torch.Tensor):
    """A block weight as a float32 [N, K] tensor without storage: `F.embedding(ids, it)`
    gathers and dequantizes only the rows asked for (the tied embedding of a block-served
    head); shape, dtype and `numel()` are the weight's; any other operation dequantizes the
    whole weight for that call (nothing keeps it)."""

    blocks: Any

    @staticmethod
    def __new__(cls, blocks: Any) -> BlockRows:
        t = torch.Tensor._make_wrapper_subclass(
            cls, blocks.shape, dtype=torch.float32, device=torch.device("cpu"))
        t.blocks = blocks
        return t

    def __init__(self, blocks: Any):
        super().__init__()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"BlockRows({self.blocks!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) == 2 and isinstance(args[1], BlockRows) \
                and kwargs.get("padding_idx") is None and kwargs.get("max_norm") is None:
            ids = args[0]  # (F.embedding passes its other defaults: no effect on a lookup)
            return args[1].blocks.rows(ids).view(*ids.shape, args[1].shape[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def dense(a):
            return a.blocks.dequantized() if isinstance(a, BlockRows) else a
        return func(*tree_map(dense, args), **tree_map(dense, kwargs or {}))
