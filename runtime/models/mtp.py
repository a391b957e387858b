"""DeepSeek-V3/R1's multi-token-prediction (MTP) module, served as a speculative proposer.

A checkpoint with `num_nextn_predict_layers` = 1 stores the module as one more layer after the
decoder's (`model.layers.{N}.*` of N layers): `enorm`, `hnorm`, `eh_proj` [hidden, 2 * hidden],
a whole decoder layer (MLA attention, MoE or dense MLP, its norms), `shared_head.norm` and
`shared_head.head` (the vocabulary projection), and possibly its own `embed_tokens`; where the
embedding or the head is absent, the main model's is used (DeepSeek shares them).

For the token at position i, with the main model's final hidden state h_i (before the final
norm), the module predicts token i + 2:

    x_i = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])     (the embedding first, as vLLM)
    g_i = the decoder layer over the sequence x_0, x_1, ... (causal, at positions i, its own
          paged KV cache), its output plus its residual (the pre-norm hidden state)
    logits(t_{i+2}) = head(shared_head.norm(g_i))

For more than one draft per step the module runs again on its own output (vLLM's and SGLang's
rule for K > 1): x = eh_proj([enorm(embed(draft)) | hnorm(g_i)]) at position i + 1, and so on.
The drafting itself (which rows, when, the cache) is runtime/spec_decode/mtp_drafter.py's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

import kernels
from contract.config import ModelConfig
from runtime.models.attention import AttentionMetadata
from runtime.models.linear import Linear
from runtime.models.llama import DecoderLayer, LlamaModel
from runtime.models.weights import LinearMaker, ModelWeights, one_thread

# the tensors an MTP layer needs beyond its decoder layer's (under model.layers.{N}.)
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def mtp_prefix(cfg: ModelConfig, depth: int = 0) -> str:
    """The name prefix of the MTP layer at `depth` (numbered after the decoder's layers)."""
    return f"model.layers.{cfg.num_hidden_layers + depth}."


def missing_mtp_tensors(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> list[str]:
    p = mtp_prefix(cfg)
    return [p + n for n in MTP_TENSORS if p + n not in weights]


class MTPModule:
    """One MTP layer built with the target's LinearMaker forms; the target lends its
    embedding and head where the checkpoint has none of the module's own."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], target: LlamaModel,
                 linear: LinearMaker):
        missing = missing_mtp_tensors(cfg, weights)
        if missing:
            raise ValueError(f"no multi-token-prediction layer: missing {missing[:3]}")
        p = mtp_prefix(cfg)
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        w = ModelWeights(weights, target.device, target.dtype)
        with one_thread():
            self.enorm = w.tensor(p + "enorm.weight")
            self.hnorm = w.tensor(p + "hnorm.weight")
            self.eh_proj = linear([w.matrix(p + "eh_proj.weight")])
            self.head_norm = w.tensor(p + "shared_head.norm.weight")
            self.embed = w.tensor(p + "embed_tokens.weight").contiguous() \
                if (p + "embed_tokens.weight") in w else target.embed
            self.head: Linear = linear([w.matrix(p + "shared_head.head.weight")]) \
                if (p + "shared_head.head.weight") in w else target.lm_head
            # the layer's own config: one layer, MoE where the checkpoint has its router
            moe = bool(cfg.num_experts) and (p + "mlp.gate.weight") in w
            layer_cfg = dataclasses.replace(cfg, num_hidden_layers=1, layer_windows=(),
                                            moe_layers=(moe,) if cfg.num_experts else ())
            self.layer = DecoderLayer(layer_cfg, w, p, linear, 0, None)
        self.own_head = self.head is not target.lm_head

    def linears(self) -> list[Linear]:
        """Every Linear a draft token runs, the head last (the governor weighs their bytes)."""
        return [self.eh_proj, *self.layer.linears(), self.head]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """input_ids [T]: the tokens t_{i+1}; hidden [T, H]: h_i (the target's, before its
        final norm, or the module's own output when drafting on). Returns g [T, H], the
        module's pre-norm output (`compute_logits` takes it, the next draft feeds on it)."""
        e = kernels.rms_norm(F.embedding(input_ids, self.embed), self.enorm, self.eps)
        h = kernels.rms_norm(hidden.to(e.dtype), self.hnorm, self.eps)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        out, residual = self.layer.forward(x, None, k_cache, v_cache, meta)
        return out + residual

    @torch.inference_mode()
    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.head(kernels.rms_norm(g, self.head_norm, self.eps)).float()
