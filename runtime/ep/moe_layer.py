"""A real `SparseMoE` block (runtime/models/moe.py) with random weights at a chosen width: what
the simulator times this machine's expert GEMMs on, and what the tests dispatch through a
placement. DeepSeek-V3's form: sigmoid group-limited router, one shared expert as wide as a
routed one."""
from __future__ import annotations

import torch

from contract.config import ModelConfig
from runtime.models.moe import ExpertLoad, SparseMoE
from runtime.models.weights import LinearMaker, ModelWeights

PREFIX = "model.layers.0.mlp."


def random_moe(hidden: int, intermediate: int, experts: int, k: int, groups: int = 1,
               groups_kept: int = 1, seed: int = 0, load: ExpertLoad | None = None
               ) -> SparseMoE:
    """One float32 DeepSeek-V3-style MoE block on the CPU, layer 0 of `load` if given."""
    cfg = ModelConfig(architecture="deepseek_v3", vocab_size=8, hidden_size=hidden,
                      intermediate_size=intermediate, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1,
                      max_position_embeddings=8, num_experts=experts, experts_per_token=k,
                      moe_intermediate_size=intermediate,
                      shared_expert_intermediate_size=intermediate,
                      router="sigmoid_group_topk", router_normalizes=True,
                      router_groups=groups, router_groups_kept=groups_kept)
    g = torch.Generator().manual_seed(seed)

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    w = {PREFIX + "gate.weight": rand(experts, hidden)}
    names = [f"experts.{e}." for e in range(experts)] + ["shared_experts."]
    for n in names:
        w[PREFIX + n + "gate_proj.weight"] = rand(intermediate, hidden)
        w[PREFIX + n + "up_proj.weight"] = rand(intermediate, hidden)
        w[PREFIX + n + "down_proj.weight"] = rand(hidden, intermediate)
    maker = LinearMaker("none", torch.float32, None, None)
    return SparseMoE(cfg, ModelWeights(w, torch.device("cpu"), torch.float32), PREFIX, maker,
                     0, load)
