"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights arrive with Hugging Face names; q/k/v and gate/up are fused into one matmul each,
which is what makes the CPU path fast. Tokens of all requests in a step are flattened into one
[T, hidden] batch; only attention knows about request boundaries (see runtime/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from runtime.attention import AttentionMetadata, PagedAttention
from runtime.config import ModelConfig


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        a = prefix + "self_attn."
        self.qkv_weight = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"],
                                     w[a + "v_proj.weight"]]).contiguous()
        self.qkv_bias = None
        if cfg.attention_bias or (a + "q_proj.bias") in w:
            self.qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"],
                                       w[a + "v_proj.bias"]]).contiguous()
        self.o_weight = w[a + "o_proj.weight"].contiguous()
        m = prefix + "mlp."
        self.gate_up_weight = torch.cat([w[m + "gate_proj.weight"],
                                         w[m + "up_proj.weight"]]).contiguous()
        self.down_weight = w[m + "down_proj.weight"].contiguous()
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_norm = w[prefix + "post_attention_layernorm.weight"]
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata):
        if residual is None:
            residual = x
            h = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = kernels.rms_norm(x, self.input_norm, self.eps, residual)
        t = h.shape[0]
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # one rotary call covers the query and key heads together
        qk = kernels.apply_rotary(qkv[:, :nq + nk].view(t, -1, self.head_dim), meta.cos, meta.sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, nq + nk:].view(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, k_cache, v_cache, meta)
        h = F.linear(attn.reshape(t, nq), self.o_weight)
        h, residual = kernels.rms_norm(h, self.post_norm, self.eps, residual)
        h = F.linear(kernels.silu_and_mul(F.linear(h, self.gate_up_weight)), self.down_weight)
        return h, residual


class LlamaModel:
    """Inference-only: plain tensors, no autograd, no nn.Module bookkeeping per call."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.")
                       for i in range(cfg.num_hidden_layers)]
        self.norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed) if not cfg.tie_word_embeddings \
            else self.embed

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids: [T]; returns final hidden states [T, hidden] (before the LM head)."""
        x = F.embedding(input_ids, self.embed)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, k_cache, v_cache, meta)
        x, _ = kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
