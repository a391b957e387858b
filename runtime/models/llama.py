"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights arrive with Hugging Face names; q/k/v and gate/up are fused into one matmul each,
which is what makes the CPU path fast, and each matmul is a `runtime/models/linear.py` Linear:
float, or weight-only quantized for small steps (`quantization` int8/int4). A GGUF's quantized
matrices come as the file's own blocks (`ModelWeights.matrix`): with int4 they are served as
they are (fused parts stacked), otherwise dequantized, as any float weight. Tokens of all requests
in a step are flattened into one [T, hidden] batch; only attention knows about request boundaries
(see runtime/models/attention.py). A mixture-of-experts layer (Mixtral, Qwen2/3-MoE) has a
`runtime/models/moe.py` SparseMoE in place of the MLP; the tokens routed to each expert are
counted in the model's `expert_load`. DeepSeek-V2/V3 layers attend with Multi-head Latent
Attention (runtime/models/mla.py) over a latent cache that is both K and V: their layers get
the one tensor twice.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F

import kernels
from contract.config import ModelConfig
from runtime.loading.calibration import Calibration
from runtime.models.attention import AttentionMetadata, PagedAttention
from runtime.models.linear import Linear
from runtime.models.mla import LatentAttention
from runtime.models.moe import ExpertLoad, SparseMoE
from runtime.models.weights import LinearMaker, ModelWeights, log_build, one_thread


def _fused_or_parts(w: ModelWeights, fused: str, parts: list[str]) -> list:
    """A projection's matrices: the checkpoint's fused one (Phi-3's qkv_proj, gate_up_proj,
    in our order) or its parts, stacked by the Linear."""
    return [w.matrix(fused)] if fused in w else [w.matrix(p) for p in parts]


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: ModelWeights, prefix: str, linear: LinearMaker,
                 index: int = 0, expert_load: ExpertLoad | None = None):
        a = prefix + "self_attn."
        self.latent: LatentAttention | None = None
        if cfg.is_latent_attention:  # DeepSeek's MLA: its own projections, no qkv / o_proj
            self.latent = LatentAttention(cfg, w, a, linear)
        else:
            qkv_bias = None
            if cfg.attention_bias or (a + "q_proj.bias") in w:
                qkv_bias = torch.cat([w.tensor(a + "q_proj.bias"), w.tensor(a + "k_proj.bias"),
                                      w.tensor(a + "v_proj.bias")]).contiguous()
            self.qkv = linear(_fused_or_parts(w, a + "qkv_proj.weight", [
                a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]), qkv_bias)
            self.o_proj = linear([w.matrix(a + "o_proj.weight")])
        m = prefix + "mlp."
        self.moe: SparseMoE | None = None
        if cfg.is_moe_layer(index):
            self.moe = SparseMoE(cfg, w, m, linear, index, expert_load)
        else:
            self.gate_up = linear(_fused_or_parts(w, m + "gate_up_proj.weight", [
                m + "gate_proj.weight", m + "up_proj.weight"]))
            self.down = linear([w.matrix(m + "down_proj.weight")])
        self.input_norm = w.tensor(prefix + "input_layernorm.weight")
        # Llama's norm before the MLP is its "post_attention_layernorm"; Gemma's sandwich
        # normalises attention's output with that name and has its own pre-MLP norm
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.attn_out_norm = w.tensor(prefix + "post_attention_layernorm.weight")
            self.post_norm = w.tensor(prefix + "pre_feedforward_layernorm.weight")
            self.mlp_out_norm = w.tensor(prefix + "post_feedforward_layernorm.weight")
        else:
            self.post_norm = w.tensor(prefix + "post_attention_layernorm.weight")
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = w.tensor(a + "q_norm.weight")
            self.k_norm = w.tensor(a + "k_norm.weight")
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.window(index)
        self.local_rope = self.window > 0 and cfg.rope_local_theta is not None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   cfg.attention_scale, self.window)

    @property
    def plain(self) -> bool:
        """A Llama layer exactly (what the fused C decode layer computes)."""
        return not (self.sandwich or self.q_norm is not None or self.gelu or self.window
                    or self.moe is not None or self.latent is not None)

    def linears(self) -> list[Linear]:
        mlp = self.moe.linears() if self.moe is not None else [self.gate_up, self.down]
        attn = self.latent.linears() if self.latent is not None else [self.qkv, self.o_proj]
        return [*attn, *mlp]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata):
        if residual is None:
            residual = x
            h = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = kernels.rms_norm(x, self.input_norm, self.eps, residual)
        if self.latent is not None:  # k_cache is v_cache: the layer's latent rows
            h = self.latent(h, k_cache, meta)
        else:
            h = self._attention(h, k_cache, v_cache, meta)
        if self.sandwich:
            h = kernels.rms_norm(h, self.attn_out_norm, self.eps)
        h, residual = kernels.rms_norm(h, self.post_norm, self.eps, residual)
        if self.moe is not None:
            h = self.moe(h)
        else:
            gate_up = self.gate_up(h)
            h = self.down(_gelu_and_mul(gate_up) if self.gelu else kernels.silu_and_mul(gate_up))
        if self.sandwich:
            h = kernels.rms_norm(h, self.mlp_out_norm, self.eps)
        return h, residual

    def _attention(self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        t = h.shape[0]
        qkv = self.qkv(h)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk = qkv[:, :nq + nk]
        if self.q_norm is not None:  # per head, before rope (Qwen 3, Gemma 3)
            qk = torch.cat([self._head_norm(qk[:, :nq], self.q_norm),
                            self._head_norm(qk[:, nq:], self.k_norm)], dim=1)
        cos, sin = (meta.local_cos, meta.local_sin) if self.local_rope else (meta.cos, meta.sin)
        # one rotary call covers the query and key heads together
        qk = kernels.apply_rotary(qk.view(t, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, nq + nk:].view(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(attn.reshape(t, nq))

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        return kernels.rms_norm(x.reshape(-1, self.head_dim), weight, self.eps).view(t, -1)


def _gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu_tanh(gate) * up, the halves of one fused projection (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class LlamaModel:
    """Inference-only: plain tensors, no autograd, no nn.Module bookkeeping per call."""

    keep_prenorm = False  # forward keeps its last hidden states before the final norm
    prenorm: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str = "none", calibration: Calibration | None = None,
                 max_quant_rows: int | None = None):
        start = time.perf_counter()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantization = quantization
        linear = LinearMaker(quantization, dtype, calibration, max_quant_rows, self.device)
        w = ModelWeights(weights, self.device, dtype)
        with one_thread():
            self._build(cfg, w, linear)
        built = time.perf_counter()
        linear.set_crossovers()
        self.packed_bytes = linear.packed_bytes
        linear.calibration.save()
        # decode-only steps run each layer as one C call where the layers fit it (CPU int8)
        # (Llama layers only: the C layer knows no q/k norms, sandwich norms, GeGLU or windows)
        plain = all(layer.plain for layer in self.layers)
        self.fused = kernels.fused_decoder(self.layers, dtype) \
            if self.device.type == "cpu" and plain else None
        log_build(linear, w, built - start, time.perf_counter() - built)

    def _build(self, cfg: ModelConfig, w: ModelWeights, linear: LinearMaker) -> None:
        # tokens routed to each expert, per layer (None for a dense model)
        self.expert_load = ExpertLoad(cfg.num_hidden_layers, cfg.num_experts, self.device) \
            if cfg.num_experts else None
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.", linear, i, self.expert_load)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = w.tensor("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in w:
            # tied: the embedding rows are the head's weights, quantized alike
            self.lm_head = linear([w.matrix("model.embed_tokens.weight")])
            self.embed = self.lm_head.weight
        else:
            self.embed = w.tensor("model.embed_tokens.weight").contiguous()
            self.lm_head = linear([w.matrix("lm_head.weight")])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids: [T]; returns final hidden states [T, hidden] (before the LM head)."""
        x = F.embedding(input_ids, self.embed)
        if self.cfg.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden), in the model's dtype
            x = x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)
        if self.fused is not None and self.fused.takes(meta, x.shape[0], kv_caches):
            x, residual = self.fused.forward(x, meta, kv_caches)
        else:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x, residual = layer.forward(x, residual, k_cache, v_cache, meta)
        x, prenorm = kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        if self.keep_prenorm:  # the hidden states before the final norm (an MTP drafter's)
            self.prenorm = prenorm
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def linears(self) -> list[Linear]:
        """Every Linear, the head last (benchmarks time them; the engine counts their bytes)."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]
