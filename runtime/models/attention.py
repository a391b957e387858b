"""Per-step attention metadata and the paged attention layer that reads it.

The runner packs the step's tokens as [decode tokens (one per request) | prefill and extend
chunks] (runtime/execution/step_inputs.py); this metadata is built once from those flat tensors and
every layer reuses it. Decodes attend straight from their block tables and context lengths,
all chunks of the step in one varlen call per layer; `kernels` decides what runs and builds
what its choice reads besides the tables once per step (`decode_slots`, `prefill_plan`).
Building it makes no host sync, so it runs inside a CUDA-graph capture too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from contract.config import ModelConfig
from runtime.execution.step_inputs import StepLayout, StepTensors
from runtime.models.rope import rope_frequencies
from runtime.models.window_attention import longest_context, windowed_attention


class RotaryTable:
    """cos and signed sin of every position a sequence can reach (kernels.rotary_cos_sin),
    built once: a step gathers its positions' rows in two ops instead of a dozen (the same
    values: each row is computed from its position alone)."""

    def __init__(self, max_positions: int, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device):
        positions = torch.arange(max_positions, device=device)
        inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta,
                                            cfg.rope_scaling, device)
        self.cos, self.sin = kernels.rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta,
                                                    dtype, inv_freq=inv_freq, factor=factor)
        self.local: RotaryTable | None = None  # the windowed layers' own (plain) rope
        if cfg.rope_local_theta is not None:
            self.local = RotaryTable(max_positions, _plain_rope(cfg), dtype, device)

    @staticmethod
    def key(cfg: ModelConfig) -> tuple:
        """What the tables depend on: equal keys, equal tables."""
        return (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def _plain_rope(cfg: ModelConfig) -> ModelConfig:
    """The windowed layers' rope: their own base, no scaling."""
    import dataclasses

    from contract.rope import DEFAULT_ROPE
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=DEFAULT_ROPE,
                               rope_local_theta=None, layer_windows=())


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored
    cos: torch.Tensor  # [T, 1, head_dim] (see kernels.rotary_cos_sin)
    sin: torch.Tensor
    block_size: int
    num_decode: int
    # decodes: the first num_decode sequences
    decode_tables: torch.Tensor  # [num_decode, W]
    decode_lens: torch.Tensor  # [num_decode]
    decode_slots: torch.Tensor | None  # what the reference reads (kernels.decode_slots)
    decode_valid: torch.Tensor | None
    # prefill and extend chunks: the other sequences, one varlen call
    num_chunks: int
    chunk_tables: torch.Tensor  # [num_chunks, W]
    chunk_starts: torch.Tensor  # [num_chunks + 1] rows in the step's tokens
    chunk_prefix: torch.Tensor  # [num_chunks] tokens already cached
    max_chunk: int  # the longest chunk (sizes the varlen grid without a sync)
    chunk_seqs: list | None  # what the reference reads (kernels.prefill_plan)
    # the windowed layers' rope where it differs from the global layers' (Gemma 3)
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    _longest: int | None = None

    def longest_context(self) -> int:
        """The furthest position + 1 a query of the step reaches (read once, for windows)."""
        if self._longest is None:
            self._longest = longest_context(self)
        return self._longest

    @classmethod
    def build(cls, t: StepTensors, layout: StepLayout, block_size: int,
              rotary: RotaryTable) -> AttentionMetadata:
        cos, sin = rotary(t.positions)
        local = rotary.local(t.positions) if rotary.local is not None else (None, None)
        nd = layout.num_decode
        tables, lens = t.block_tables[:nd], t.context_lens[:nd]
        slots = valid = None
        if nd:
            slots, valid = kernels.decode_slots(tables, lens, block_size,
                                                layout.max_decode_context, cos.dtype)
        chunks = layout.num_seqs - nd
        chunk_tables, starts, prefix = t.block_tables[nd:], t.query_start[nd:], t.num_prefix[nd:]
        seqs = (kernels.prefill_plan(chunk_tables, block_size, starts, prefix, cos.dtype)
                if chunks else None)
        return cls(t.slot_mapping, cos, sin, block_size, nd, tables, lens, slots, valid,
                   chunks, chunk_tables, starts, prefix, layout.max_query, seqs, *local)


class PagedAttention:
    """Stores new K/V in the layer's cache, then attends decodes and prefill chunks; a layer
    with a `window` sees only that many positions back: in the C kernels where they run,
    else through runtime/models/window_attention.py's reference path."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, window: int = 0):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        window = 0  # the kernels' own window, where a context reaches past it
        if self.window and meta.longest_context() > self.window:
            if not kernels.windows_in_kernels(q, k_cache, v_cache):
                return windowed_attention(q, k_cache, v_cache, meta, self.window, self.scale,
                                          out)
            window = self.window
        nd = meta.num_decode
        # decode
        if nd:
            kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_slots, meta.decode_valid, self.scale,
                block_tables=meta.decode_tables, context_lens=meta.decode_lens,
                block_size=meta.block_size, out=out[:nd], window=window)
        # prefill
        if meta.num_chunks:
            kernels.prefill_attention_varlen(
                q, k_cache, v_cache, meta.chunk_tables, meta.block_size, meta.chunk_starts,
                meta.chunk_prefix, self.scale, meta.max_chunk, seqs=meta.chunk_seqs,
                k_new=k, v_new=v, out=out, window=window)
        return out
