"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights arrive with Hugging Face names; q/k/v and gate/up are fused into one matmul each,
which is what makes the CPU path fast, and each matmul is a `runtime/models/linear.py` Linear:
float, or weight-only quantized for small steps (`quantization` int8/int4). Tokens of all requests
in a step are flattened into one [T, hidden] batch; only attention knows about request boundaries
(see runtime/models/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from contract.config import ModelConfig
from runtime.loading.calibration import Calibration
from runtime.loading.quantization import (
    INT4_GROUP,
    BlockWeight,
    Int4Weight,
    Int8BlockWeight,
    Int8Weight,
)
from runtime.models.attention import AttentionMetadata, PagedAttention
from runtime.models.linear import Linear


class LinearMaker:
    """Builds the model's Linears in one format; with quantization, the packed weight, its
    float dequantization (the large-step path) and the measured crossover between them."""

    def __init__(self, quantization: str, dtype: torch.dtype, calibration: Calibration | None,
                 max_quant_rows: int | None):
        self.quantization = quantization
        self.dtype = dtype
        self.calibration = calibration or Calibration(None)
        self.max_quant_rows = max_quant_rows  # None: measured per shape
        self.packed_bytes = 0

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        if self.quantization == "none":
            return Linear(weight.contiguous(), bias)
        small = self._exact_blocks(weight)
        if small is not None:  # int4: the file's own blocks, and the same weights in float
            dense = weight.to(self.dtype).contiguous()
            rows = self._crossover(small.kind, dense, small)
            self.packed_bytes += small.nbytes
            return Linear(dense, bias, small=small, max_small_rows=rows)
        packed = Int8Weight(weight)
        self.packed_bytes += packed.nbytes
        dense = packed.dequantized().to(self.dtype).contiguous()
        return Linear(dense, bias, packed, self._crossover("int8", dense, packed))

    def _crossover(self, kind: str, dense: torch.Tensor, packed: Int8Weight | BlockWeight) -> int:
        if self.max_quant_rows is not None:
            return self.max_quant_rows
        return self.calibration.max_quant_rows(kind, dense, packed)

    def _exact_blocks(self, weight: torch.Tensor) -> BlockWeight | None:
        """With int4, a weight in the block form the file holds it in (4-bit, else 8-bit),
        where the C kernel runs it; a weight neither form holds exactly (a float checkpoint's)
        goes int8 per row instead: nothing is rounded to fit a block."""
        if self.quantization != "int4" or weight.shape[1] % INT4_GROUP \
                or not kernels.cpu_ops_take(self.dtype) or weight.device.type != "cpu":
            return None
        for form in (Int4Weight, Int8BlockWeight):
            small = form(weight)
            if small.exact:
                return small
        return None


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 linear: LinearMaker):
        a = prefix + "self_attn."
        qkv_bias = None
        if cfg.attention_bias or (a + "q_proj.bias") in w:
            qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"],
                                  w[a + "v_proj.bias"]]).contiguous()
        self.qkv = linear(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"],
                                     w[a + "v_proj.weight"]]), qkv_bias)
        self.o_proj = linear(w[a + "o_proj.weight"])
        m = prefix + "mlp."
        self.gate_up = linear(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        self.down = linear(w[m + "down_proj.weight"])
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
        qkv = self.qkv(h)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # one rotary call covers the query and key heads together
        qk = kernels.apply_rotary(qkv[:, :nq + nk].view(t, -1, self.head_dim), meta.cos, meta.sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, nq + nk:].view(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, k_cache, v_cache, meta)
        h = self.o_proj(attn.reshape(t, nq))
        h, residual = kernels.rms_norm(h, self.post_norm, self.eps, residual)
        h = self.down(kernels.silu_and_mul(self.gate_up(h)))
        return h, residual


class LlamaModel:
    """Inference-only: plain tensors, no autograd, no nn.Module bookkeeping per call."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str = "none", calibration: Calibration | None = None,
                 max_quant_rows: int | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantization = quantization
        linear = LinearMaker(quantization, dtype, calibration, max_quant_rows)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.", linear)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = w["model.norm.weight"]
        embed = w["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings or "lm_head.weight" not in w:
            # tied: the embedding rows are the head's weights, quantized alike
            self.lm_head = linear(embed)
            self.embed = self.lm_head.weight
        else:
            self.embed = embed.contiguous()
            self.lm_head = linear(w["lm_head.weight"])
        self.packed_bytes = linear.packed_bytes
        linear.calibration.save()
        # decode-only steps run each layer as one C call where the layers fit it (CPU int8)
        self.fused = kernels.fused_decoder(self.layers, dtype) if self.device.type == "cpu" \
            else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids: [T]; returns final hidden states [T, hidden] (before the LM head)."""
        x = F.embedding(input_ids, self.embed)
        if self.fused is not None and self.fused.takes(meta, x.shape[0], kv_caches):
            x, residual = self.fused.forward(x, meta, kv_caches)
        else:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x, residual = layer.forward(x, residual, k_cache, v_cache, meta)
        x, _ = kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def linears(self) -> list[Linear]:
        """Every Linear, the head last (benchmarks time them; the engine counts their bytes)."""
        return [lin for layer in self.layers
                for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [self.lm_head]
