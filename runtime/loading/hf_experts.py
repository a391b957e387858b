"""What a mixture-of-experts Hugging Face folder needs beyond a dense one: the MoE fields of
ModelConfig its config.json implies (Mixtral, Qwen2/3-MoE, DeepSeek's DeepSeekMoE), its expert
tensors under one set of names (the Hub's Qwen form `model.layers.N.mlp.experts.E.{gate,up,
down}_proj.weight`: Mixtral's `block_sparse_moe.experts.E.w1/w3/w2` renamed, transformers 5's
stacked 3-D tensors split per expert as views), and the tensors each MoE layer is built from
(runtime/loading/hf.py calls these)."""
from __future__ import annotations

import re

import torch

from contract.config import ModelConfig


def moe_traits(arch: str, raw: dict, layers: int) -> dict:
    """The mixture-of-experts fields of ModelConfig a config.json implies ({} for a dense
    family). Router settings we do not serve are refused by name, never served another way.
    The DeepSeek branch: V2's softmax, V3's sigmoid with the correction bias."""
    if arch == "mixtral":  # every layer; softmax over the top k logits
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        return _moe(experts, raw, moe_intermediate_size=int(raw["intermediate_size"]),
                    router="softmax_topk", router_normalizes=True)
    if arch in ("qwen2_moe", "qwen3_moe"):
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        flags = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        traits = _moe(experts, raw, moe_intermediate_size=int(
            raw["moe_intermediate_size"]), router="softmax_topk",
            router_normalizes=bool(raw.get("norm_topk_prob", False)), moe_layers=flags)
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe" and shared and traits:  # always gated in Qwen2-MoE
            traits.update(shared_expert_intermediate_size=shared, shared_expert_gated=True)
        return traits
    if arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(arch, raw, layers)
    return {}


def _moe(experts: int, raw: dict, **traits) -> dict:
    """(Mixtral's router_jitter_noise acts in training only: nothing to serve.)"""
    if not experts:
        return {}
    k = raw.get("num_experts_per_tok")
    if k is None:
        raise ValueError("num_experts_per_tok is missing")
    return {"num_experts": experts, "experts_per_token": int(k), **traits}


def _deepseek_moe(arch: str, raw: dict, layers: int) -> dict:
    experts = int(raw.get("n_routed_experts") or 0)
    if not experts:
        return {}
    scoring = raw.get("scoring_func") or ("sigmoid" if arch == "deepseek_v3" else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if arch == "deepseek_v3" else "greedy")
    normalize = bool(raw.get("norm_topk_prob", arch == "deepseek_v3"))
    if (scoring, method) == ("sigmoid", "noaux_tc"):
        router = "sigmoid_group_topk"
    elif (scoring, method) == ("softmax", "greedy"):
        router = "softmax_topk"
    elif (scoring, method) == ("softmax", "group_limited_greedy"):
        router = "softmax_group_topk"
    else:
        raise ValueError(f"router scoring_func {scoring!r} with topk_method {method!r} "
                         "is not served")
    if scoring == "softmax" and normalize:
        # DeepSeek-V2's own code then skips routed_scaling_factor, transformers' ignores
        # norm_topk_prob: the references disagree, so neither is guessed
        raise ValueError("norm_topk_prob with DeepSeek-V2's softmax router is not served")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    grouped = router != "softmax_topk"
    return {"num_experts": experts, "experts_per_token": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "shared_expert_intermediate_size":
                int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0),
            "router": router, "router_normalizes": normalize,
            "routed_scaling_factor": float(raw.get("routed_scaling_factor") or 1.0),
            "router_groups": int(raw.get("n_group") or 1) if grouped else 1,
            "router_groups_kept": int(raw.get("topk_group") or 1) if grouped else 1,
            "moe_layers": tuple(i >= first_dense and i % freq == 0 for i in range(layers))}


def expert_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts' tensors under the Hub's Qwen names (the module's text): Mixtral's renamed,
    transformers' stacked [E, ...] tensors split per expert (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _MIXTRAL_EXPERT.fullmatch(name)
        if m:
            name = f"{m.group(1)}{_MIXTRAL_PARTS[m.group(2)]}.weight"
        m = _STACKED_EXPERTS.fullmatch(name)
        if m and t.dim() == 3:
            prefix, part = m.group(1), m.group(2)
            for e in range(t.shape[0]):
                if part == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}{e}.gate_proj.weight"] = gate
                    out[f"{prefix}{e}.up_proj.weight"] = up
                else:
                    out[f"{prefix}{e}.down_proj.weight"] = t[e]
            continue
        out[name] = t
    return out


_MIXTRAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.\d+\.)(w1|w2|w3)\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)(?:\.weight)?")


def expert_tensors(config: ModelConfig, m: str, weights: dict) -> list[str]:
    """The tensors a MoE layer with prefix `m` ("model.layers.N.mlp.") is built from."""
    names = [m + "gate.weight"]
    names += [f"{m}experts.{e}.{part}_proj.weight" for e in range(config.num_experts)
              for part in ("gate", "up", "down")]
    if config.shared_expert_intermediate_size:
        s = m + ("shared_experts." if m + "shared_experts.down_proj.weight" in weights
                 else "shared_expert.")
        names += [f"{s}{part}_proj.weight" for part in ("gate", "up", "down")]
        if config.shared_expert_gated:
            names.append(m + "shared_expert_gate.weight")
    if config.router == "sigmoid_group_topk":
        names.append(m + "gate.e_score_correction_bias")
    return names
