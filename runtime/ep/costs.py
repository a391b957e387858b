"""What one token costs in one layer, for the simulator: DeepSeek-V3's published shapes, an
H800's published figures, the roofline that turns FLOPs and bytes into seconds, and this CPU's
measured expert GEMM (a real `SparseMoE` block, runtime/ep/moe_layer.py).

Per token and layer (FP8 weights, one byte per parameter):
- attention: MLA's projections (q_a, q_b, kv_a, o; prefill also expands the latent with kv_b,
  decode absorbs kv_b into the query and the output instead) plus the core over `context`
  cached tokens (BF16), and, in decode, the latent cache read: (kv_lora + rope) values a
  context token;
- a routed or shared expert: gate, up and down, 6 * hidden * moe_intermediate FLOPs, its
  3 * hidden * moe_intermediate bytes of weights read once a step by the GPU holding it.
A kernel's time is max(FLOPs / (peak * gemm_efficiency), bytes / (HBM * memory_efficiency)).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3)."""

    layers: int = 61
    moe_layers: int = 58
    experts: int = 256
    k: int = 8
    shared: int = 1
    hidden: int = 7168
    moe_intermediate: int = 2048
    dense_intermediate: int = 18432
    groups: int = 8
    groups_kept: int = 4
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    vocab: int = 129280


@dataclass(frozen=True)
class Hardware:
    """An H800 SXM node's published figures (per GPU; links one direction)."""

    fp8_tflops: float = 1979.0  # dense
    bf16_tflops: float = 989.0  # dense
    hbm_gbs: float = 3350.0
    nvlink_gbs: float = 160.0  # achievable, as DeepSeek-V3's report states
    ib_gbs: float = 50.0  # one 400 Gb/s NIC per GPU
    gpus_per_node: int = 8
    gemm_efficiency: float = 0.6
    memory_efficiency: float = 0.8

    def seconds(self, fp8_flops: float, bytes_read: float, bf16_flops: float = 0.0) -> float:
        compute = fp8_flops / (self.fp8_tflops * 1e12 * self.gemm_efficiency) \
            + bf16_flops / (self.bf16_tflops * 1e12 * self.gemm_efficiency)
        return max(compute, bytes_read / (self.hbm_gbs * 1e9 * self.memory_efficiency))


def expert_flops(m: ModelShape) -> float:
    return 6.0 * m.hidden * m.moe_intermediate


def expert_bytes(m: ModelShape) -> float:
    return 3.0 * m.hidden * m.moe_intermediate


def attention_weight_bytes(m: ModelShape) -> float:
    return float(m.hidden * m.q_lora + m.q_lora * m.heads * (m.qk_nope + m.qk_rope)
                 + m.hidden * (m.kv_lora + m.qk_rope)
                 + m.kv_lora * m.heads * (m.qk_nope + m.v_head) + m.heads * m.v_head * m.hidden)


def attention_flops(m: ModelShape, context: float, decode: bool) -> tuple[float, float]:
    """(FP8 projection FLOPs, BF16 core FLOPs) of one token attending to `context` tokens."""
    proj = 2.0 * (m.hidden * m.q_lora + m.q_lora * m.heads * (m.qk_nope + m.qk_rope)
                  + m.hidden * (m.kv_lora + m.qk_rope) + m.heads * m.v_head * m.hidden)
    # kv_b: prefill expands each token's latent; decode absorbs it into q and the output
    proj += 2.0 * m.kv_lora * m.heads * (m.qk_nope + m.v_head)
    if decode:
        core = 2.0 * m.heads * context * ((m.kv_lora + m.qk_rope) + m.kv_lora)
    else:
        core = 2.0 * m.heads * context * ((m.qk_nope + m.qk_rope) + m.v_head)
    return proj, core


def kv_bytes_per_context_token(m: ModelShape, kv_bytes: float = 2.0) -> float:
    return (m.kv_lora + m.qk_rope) * kv_bytes


def measure_cpu_expert_seconds(hidden: int = 1792, intermediate: int = 512, experts: int = 8,
                               tokens: int = 256, repeats: int = 3) -> dict[str, float]:
    """This CPU's routed-expert time per (token, expert) assignment: a real `SparseMoE` block at
    `hidden` x `intermediate` (DeepSeek-V3's widths / 4 by default: the full ones do not fit
    256 experts in memory), its best of `repeats`; returns the seconds per assignment and the
    FLOP rate achieved, and the seconds per assignment at V3's widths at that rate."""
    from runtime.ep.moe_layer import random_moe
    moe = random_moe(hidden, intermediate, experts, 2, seed=0)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.router(x)
    moe.routed(x, weights, ids)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        moe.routed(x, weights, ids)
        best = min(best, time.perf_counter() - start)
    per_assignment = best / ids.numel()
    rate = 6.0 * hidden * intermediate / per_assignment
    return {"seconds_per_assignment": per_assignment, "flops_per_s": rate,
            "v3_seconds_per_assignment": expert_flops(ModelShape()) / rate}
