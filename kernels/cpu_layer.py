"""The fused CPU decode layer (kernels/cpu/decode_layer.c): what it reads, and when it runs.

A model whose every projection is int8, or a file's own blocks (any block form; without a
float copy, as runtime/models/linear.py serves them, or with one), on the compiled ops gets a
`FusedDecoder`. For a step of decodes only, float32, no larger than every projection's limit
(its int8 crossover, runtime/models/linear.py; `F32_MAX_ROWS` for a block weight with a float
copy; none for one without), it runs each layer as one C call instead of ten ops; any other
step (prefill or extend chunks, a large batch, another dtype) takes the op-by-op path, which
computes the same thing.
The weight pointers are gathered once into C structs; the model keeps the tensors alive.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cpu_ops, kv_int8
from kernels.cpu_api import LayerWeights, Matrix, StepCache  # mirrored from kernels/cpu/api.h

# a block weight's steps above its crossover run the float copy in C (f32_ops.c) up to here
# (every decode-only step the default 64-sequence batch makes), op by op beyond
F32_MAX_ROWS = 128
# a block weight without a float copy (a K-quant) runs its blocks fused at any decode-only
# step: the kernel dequantizes panels itself, so no size needs another path
BLOCK_MAX_ROWS = 1 << 30


def _dense(linear) -> torch.Tensor | None:
    """The float copy the C layer may read for a block weight's larger steps: float32,
    contiguous; None where the Linear keeps none (a K-quant's blocks serve every size)."""
    # a Linear's `dense` (its `weight` may be a storage-less view of its blocks)
    w = linear.dense if hasattr(linear, "dense") else getattr(linear, "weight", None)
    if type(w) is torch.Tensor and w.dtype == torch.float32 and w.is_contiguous():
        return w
    return None


def _matrix(linear, keep: list) -> Matrix | None:
    """The C view of a Linear: its int8 form, or the file's own blocks (with the float copy
    where it keeps one; a chain of matrices where its rows come in several block forms, the
    later ones appended to `keep`, which must outlive the view); None for a float-only
    weight."""
    packed, small = linear.packed, linear.small
    if packed is None and small is None:
        return None
    bias = None if linear.bias is None else linear.bias.data_ptr()
    if packed is not None:
        return Matrix(packed.q.data_ptr(), packed.panels.data_ptr(), packed.scale.data_ptr(),
                      bias, *linear.shape)
    dense, k = _dense(linear), small.shape[1]
    parts = getattr(small, "parts", (small,))  # StackedBlocks: one matrix per block form
    chain, at = [], 0
    for part in parts:
        chain.append(Matrix(
            None, None, None, None if bias is None else bias + 4 * at, part.shape[0], k,
            part.qs.data_ptr(), None if part.d is None else part.d.data_ptr(),
            None if part.m is None else part.m.data_ptr(), cpu_ops.block_format(part),
            linear.max_small_rows, None if dense is None else dense.data_ptr()))
        at += part.shape[0]
    for head, tail in zip(chain, chain[1:]):
        head.next = ctypes.pointer(tail)
    keep += chain[1:]  # the first is copied into its LayerWeights; `next` points at these
    return chain[0]


def _max_rows(linear) -> int:
    """Up to how many rows the fused layer runs this weight: its int8 crossover, or for a
    block weight (no int8 form) what the float kernel covers; a block weight without a float
    copy runs its blocks at any size (the kernel's panels), bounded by the decode batch."""
    if linear.packed is not None:
        return linear.max_quant_rows
    return F32_MAX_ROWS if _dense(linear) is not None else BLOCK_MAX_ROWS


class FusedDecoder:
    def __init__(self, layers):
        self._fn = cpu_ops.api().decode_layer
        self.weights = []
        self._chained: list[Matrix] = []  # the matrices `next` points at (a chain's tail)
        rows = []
        for layer in layers:
            mats = [_matrix(lin, self._chained)
                    for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            self.weights.append(LayerWeights(
                layer.input_norm.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim,
                layer.down.shape[1], layer.eps, layer.attn.scale, layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(), *mats))
            rows += [_max_rows(lin) for lin in (layer.qkv, layer.o_proj, layer.gate_up,
                                                layer.down)]
        # above the smallest crossover some projection runs its float copy: op by op then
        self.max_rows = min(rows)
        w = self.weights[0]
        self.floats_per_row = (layers[0].qkv.shape[0] + w.heads * w.head_dim + 2 * w.inter
                               + w.inter + w.hidden)

    @classmethod
    def build(cls, layers, dtype: torch.dtype) -> FusedDecoder | None:
        """A decoder for these layers, or None where they do not fit the C layer."""
        if dtype != torch.float32 or not layers or not cpu_ops.available():
            return None
        for layer in layers:
            lins = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            # int8 needs no float copy, nor does a block weight without one (_max_rows)
            if any(lin.packed is None and lin.small is None for lin in lins) \
                    or layer.o_proj.bias is not None \
                    or layer.gate_up.bias is not None or layer.down.bias is not None:
                return None
            if layer.num_heads % layer.num_kv_heads or layer.input_norm.device.type != "cpu":
                return None
        return cls(layers)

    def takes(self, meta, num_tokens: int, kv_caches) -> bool:
        k, v = kv_caches[0]
        return (meta.num_chunks == 0 and meta.num_decode == num_tokens
                and 0 < num_tokens <= self.max_rows and meta.cos.dtype == torch.float32
                and cpu_ops.takes_caches(k, v))

    def forward(self, x: torch.Tensor, meta, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden] (the embeddings, overwritten); returns (hidden, residual) as the
        op-by-op layers leave them, for the final norm."""
        b = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        scratch = torch.empty(b * self.floats_per_row, dtype=torch.float32)
        cos = meta.cos.reshape(b, -1).contiguous()
        sin = meta.sin.reshape(b, -1).contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = meta.decode_tables if meta.decode_tables.stride(-1) == 1 \
            else meta.decode_tables.contiguous()
        lens = meta.decode_lens.contiguous()
        k0 = kv_caches[0][0]
        kv_int8.check_width(k0, self.weights[0].head_dim)  # an int8 cache: rows and scales
        step = StepCache(cos.data_ptr(), sin.data_ptr(), None, None, k0.stride(0), k0.stride(1),
                         slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.stride(0),
                         meta.block_size, cpu_ops.CACHE_KINDS[k0.dtype])
        threads = torch.get_num_threads()
        xp, rp, sp, ref = x.data_ptr(), residual.data_ptr(), scratch.data_ptr(), \
            ctypes.byref(step)
        for i, (weights, (k_cache, v_cache)) in enumerate(zip(self.weights, kv_caches)):
            step.k_cache, step.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            if self._fn(ctypes.byref(weights), xp, rp, int(i == 0), ref, b, sp, threads):
                raise MemoryError("decode attention could not allocate its score buffer")
        return x, residual
