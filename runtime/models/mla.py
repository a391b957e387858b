"""Multi-head Latent Attention (DeepSeek-V2/V3) over a latent KV cache, in the absorbed form.

Each token's keys and values come from one compressed latent c_kv (kv_lora_rank values, made
by kv_a_proj_with_mqa and normalised by kv_a_layernorm) and one rotated key part k_pe
(qk_rope_head_dim values) that every head shares. Per head h, kv_b_proj expands the latent:
key_h = [W_UK_h c_kv | k_pe], value_h = W_UV_h c_kv. So the cache holds only [c_kv | k_pe] per
token (576 values for V3, against 2 x 128 heads x 192/128 expanded), one tensor that is both
K and V (`ModelConfig.kv_shared`).

The absorbed form never expands the cache: q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, so
the query [W_UK_h^T q_nope_h | q_pe_h] (kv_lora_rank + rope values) against the cache rows is
ordinary multi-query attention (one KV head, every query head in its group), which the paged
kernels run unchanged with v_cache the same tensor as k_cache; the first kv_lora_rank values
of each head's output are the attention-weighted latent, which W_UV_h turns into the head's
value, then o_proj. Decodes and prefill chunks both run it: measured on one layer (2 CPU
threads, a chunk without a prefix) the expanded form (`expanded_attention`) was within 10% of
it up to 256-token chunks and ~20% faster at 512 for V2-Lite's 16 heads, at par for V3's 128,
and a chunk after a prefix would have to expand every cached latent of the prefix again, which
the absorbed form never does. tests/runtime/test_mla.py checks the two forms agree.

Rotary layout: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ...; the
loader (runtime/loading/hf.py) permutes the rows of q_b_proj / q_proj and kv_a_proj_with_mqa
that make the rotated part into halves [x0, x2, ... | x1, x3, ...], on which our rotary
kernel's rotate-half is the same rotation (both q and k get the same permutation, so every
dot product is unchanged). Weights reaching this module are in that halves layout.
"""
from __future__ import annotations

import torch

import kernels
from contract.config import ModelConfig
from runtime.models.attention import AttentionMetadata
from runtime.models.linear import Linear
from runtime.models.weights import LinearMaker, ModelWeights


class LatentAttention:
    """One layer's MLA: hidden states [T, hidden] in, o_proj's output [T, hidden] out; the
    layer's cache is [slots, 1, kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, cfg: ModelConfig, w: ModelWeights, prefix: str, linear: LinearMaker):
        a = prefix  # "model.layers.N.self_attn."
        self.num_heads = h = cfg.num_attention_heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attention_scale
        # both projections of the hidden state in one matmul: the query's (its low-rank
        # down-projection, or the whole query without one) and the latent + rotated key's
        q_name = a + ("q_a_proj" if cfg.q_lora_rank else "q_proj")
        self.q_width = cfg.q_lora_rank or h * (self.nope + self.rope)
        bias = None
        if (q_name + ".bias") in w or (a + "kv_a_proj_with_mqa.bias") in w:
            bias = torch.cat([self._bias(w, q_name, self.q_width),
                              self._bias(w, a + "kv_a_proj_with_mqa",
                                         self.rank + self.rope)]).contiguous()
        self.in_proj = linear([w.matrix(q_name + ".weight"),
                               w.matrix(a + "kv_a_proj_with_mqa.weight")], bias)
        self.q_up: Linear | None = None
        self.q_norm: torch.Tensor | None = None
        if cfg.q_lora_rank:
            self.q_norm = w.tensor(a + "q_a_layernorm.weight")
            self.q_up = linear([w.matrix(a + "q_b_proj.weight")])
        self.kv_norm = w.tensor(a + "kv_a_layernorm.weight")
        # kv_b_proj [H * (nope + v), rank] split per head: W_UK [H, nope, rank] takes the
        # query into the latent space, W_UV^T [H, rank, v] the attended latent out of it
        kv_b = w.tensor(a + "kv_b_proj.weight").view(h, self.nope + self.v_dim, self.rank)
        self.w_uk = kv_b[:, :self.nope].contiguous()
        self.w_uv_t = kv_b[:, self.nope:].transpose(1, 2).contiguous()
        o_bias = w.tensor(a + "o_proj.bias") if (a + "o_proj.bias") in w else None
        self.o_proj = linear([w.matrix(a + "o_proj.weight")], o_bias)

    @staticmethod
    def _bias(w: ModelWeights, name: str, width: int) -> torch.Tensor:
        if (name + ".bias") in w:
            return w.tensor(name + ".bias")
        return torch.zeros(width, dtype=w.dtype, device=w.device)

    def linears(self) -> list[Linear]:
        return [self.in_proj, *([self.q_up] if self.q_up is not None else []), self.o_proj]

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, nope], q_pe [T, H, rope] rotated, latent row [T, 1, rank + rope]:
        the normalised c_kv and the rotated k_pe, what the cache stores); cos and sin are
        the rows' rotary tables [T, 1, rope]."""
        t = h.shape[0]
        x = self.in_proj(h)
        q, kv = x[:, :self.q_width], x[:, self.q_width:]
        if self.q_up is not None:
            assert self.q_norm is not None
            q = self.q_up(kernels.rms_norm(q, self.q_norm, self.eps))
        q = q.reshape(t, self.num_heads, self.nope + self.rope)
        c_kv = kernels.rms_norm(kv[:, :self.rank], self.kv_norm, self.eps)
        # one rotary call for the query heads' rotated parts and the shared key part
        pe = torch.cat([q[:, :, self.nope:], kv[:, None, self.rank:]], dim=1)
        pe = kernels.apply_rotary(pe, cos, sin)
        latent = torch.cat([c_kv, pe[:, self.num_heads]], dim=1).view(t, 1, -1)
        return q[:, :, :self.nope], pe[:, :self.num_heads], latent

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[q_nope_h W_UK_h | q_pe_h] per head: [T, H, rank + rope]."""
        t = q_nope.shape[0]
        query = q_nope.new_empty(t, self.num_heads, self.rank + self.rope)
        query[:, :, :self.rank] = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query[:, :, self.rank:] = q_pe
        return query

    def __call__(self, h: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        t = h.shape[0]
        q_nope, q_pe, latent = self.project(h, meta.cos, meta.sin)
        query = self.absorbed_query(q_nope, q_pe)
        # K and V are the one latent tensor: stored once per token (as both, the same rows)
        kernels.store_kv(latent, latent, cache, cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decode
        if nd:
            kernels.paged_decode_attention(
                query[:nd], cache, cache, meta.decode_slots, meta.decode_valid, self.scale,
                block_tables=meta.decode_tables, context_lens=meta.decode_lens,
                block_size=meta.block_size, out=out[:nd])
        if meta.num_chunks:
            kernels.prefill_attention_varlen(
                query, cache, cache, meta.chunk_tables, meta.block_size, meta.chunk_starts,
                meta.chunk_prefix, self.scale, meta.max_chunk, seqs=meta.chunk_seqs,
                k_new=latent, v_new=latent, out=out)
        # the attended latent (the rotated part's columns are dropped) through W_UV per head
        values = torch.bmm(out[:, :, :self.rank].transpose(0, 1), self.w_uv_t)
        return self.o_proj(values.transpose(0, 1).reshape(t, self.num_heads * self.v_dim))


def expanded_attention(mla: LatentAttention, h: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """One sequence's causal attention in the expanded form (every head's keys and values made
    from the latents, then softmax attention): the reference the absorbed form is checked
    against, and what a chunk would compute expanded. h [T, hidden] at positions 0..T-1."""
    t = h.shape[0]
    q_nope, q_pe, latent = mla.project(h, cos, sin)
    c_kv, k_pe = latent[:, 0, :mla.rank], latent[:, :, mla.rank:]
    k_nope = torch.einsum("tr,hnr->thn", c_kv, mla.w_uk)
    v = torch.einsum("tr,hrv->thv", c_kv, mla.w_uv_t)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe.expand(t, mla.num_heads, mla.rope)], dim=-1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v.transpose(0, 1), is_causal=True, scale=mla.scale)
    return mla.o_proj(out.transpose(0, 1).reshape(t, mla.num_heads * mla.v_dim))
