"""Tiny random-weight checkpoints of every model family we serve, written by transformers itself.

Each family's config class and model class come from transformers, so the folder has exactly
the names, shapes and config keys of a real checkpoint of that family, and the same model,
run by transformers, is the reference our runtime is checked against (tests/runtime/
test_families.py). Every parameter is random, norms included (around their neutral value:
1 for x * w, 0 for Gemma's x * (1 + w)), so a norm read wrongly changes the logits. The
tokenizer is testkit/tiny_model.py's.

Families: llama (plain, linear, llama3 and yarn rope scaling), qwen3 (q/k norms), phi3 (fused
qkv and gate/up), gemma3 (sandwich norms, q/k norms, GeGLU, scaled embeddings, sliding-window
layers with their own rope base), and the mixtures of experts: mixtral (8 experts, 2 per token,
softmax over the top 2), qwen3_moe (8 experts, 3 per token, normalised, a dense middle layer
through `mlp_only_layers`), qwen2_moe (un-normalised, a gated shared expert); and DeepSeek's
Multi-head Latent Attention with its mixtures: deepseek_v3 (q_lora, a dense first layer, 8
experts top 2 by V3's sigmoid router in 4 groups keeping 2 with a random correction bias, one
shared expert, YaRN with mscale_all_dim, interleaved rope), deepseek_v2_lite (no q_lora, V2's
softmax greedy router, two shared experts).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from testkit.tiny_model import CHAT_TEMPLATE, build_tokenizer

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}

ROPE = {
    "llama": {"rope_type": "default", "rope_theta": 10000.0},
    "llama-linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "llama-yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 256},
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
MLA_FAMILIES = ("deepseek_v3", "deepseek_v2_lite")
FAMILIES = (*ROPE, "qwen3", "phi3", "gemma3", *MOE_FAMILIES, *MLA_FAMILIES)
# the latent attention's widths (kv_lora_rank + rope = 40 cached values per token and layer)
MLA: dict[str, Any] = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                       "v_head_dim": 16}


def _config(family: str, vocab: int, ids: dict):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**SHAPE, "vocab_size": vocab, "tie_word_embeddings": False, **ids}
    if family in ROPE:
        return LlamaConfig(**common, rope_parameters=ROPE[family])
    if family == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 1000000.0})
    if family == "phi3":
        shape = {k: v for k, v in common.items() if k != "head_dim"}  # hidden / heads
        return Phi3Config(**shape, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}, original_max_position_embeddings=1024)
    if family == "gemma3":
        # six layers: five windowed, one global, the real model's pattern; a 32-token window
        # so the tests' prompts cross it
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "tie_word_embeddings": True},
                                sliding_window=32, query_pre_attn_scalar=16,
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}})
    rope: Any = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "mixtral":
        return MixtralConfig(**common, rope_parameters=rope, num_local_experts=8,
                             num_experts_per_tok=2)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, rope_parameters=rope, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    if family == "qwen2_moe":
        shape = {k: v for k, v in common.items() if k != "head_dim"}  # hidden / heads
        return Qwen2MoeConfig(**shape, rope_parameters=rope, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=96,
                              norm_topk_prob=False)
    if family in MLA_FAMILIES:
        return _deepseek_config(family, common)
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def _deepseek_config(family: str, common: dict):
    from transformers import DeepseekV2Config, DeepseekV3Config

    shape = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    shape["num_key_value_heads"] = shape["num_attention_heads"]
    if family == "deepseek_v3":
        # mscale and mscale_all_dim differ, so both the tables' factor and the softmax's
        # scale are exercised
        return DeepseekV3Config(**shape, **MLA, q_lora_rank=32, moe_intermediate_size=32,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                routed_scaling_factor=2.5, norm_topk_prob=True,
                                rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 256, "mscale": 1.0,
                                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
    return DeepseekV2Config(**shape, **MLA, q_lora_rank=None, moe_intermediate_size=32,
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                            first_k_dense_replace=1, topk_method="greedy",
                            norm_topk_prob=False, routed_scaling_factor=1.0,
                            rope_parameters={
                                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 256, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})


def _model_class(family: str):
    import transformers

    return {"qwen3": transformers.Qwen3ForCausalLM, "phi3": transformers.Phi3ForCausalLM,
            "gemma3": transformers.Gemma3ForCausalLM,
            "mixtral": transformers.MixtralForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "qwen2_moe": transformers.Qwen2MoeForCausalLM,
            "deepseek_v3": transformers.DeepseekV3ForCausalLM,
            "deepseek_v2_lite": transformers.DeepseekV2ForCausalLM}.get(family,
                                                               transformers.LlamaForCausalLM)


def _randomize(model, family: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    neutral = 0.0 if family == "gemma3" else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(neutral + 0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def write_family_checkpoint(folder: Path, family: str, seed: int = 0):
    """Write `family`'s tiny checkpoint to `folder`; returns the transformers model (float32,
    eval mode) that holds the same weights: the reference."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    ids = {"bos_token_id": tok.token_to_id("<|im_start|>"),
           "eos_token_id": tok.token_to_id("<|im_end|>"), "pad_token_id": 0}
    config = _config(family, tok.get_vocab_size(), ids)
    torch.manual_seed(seed)
    model = _model_class(family)(config).eval()
    _randomize(model, family, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "add_bos_token": False}))
    return model


def add_mtp_layer(folder: Path, seed: int = 1, like_layer: int = 1,
                  own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """Add one DeepSeek multi-token-prediction layer to a tiny deepseek_v3 folder, as
    DeepSeek-V3/R1 ship it (transformers writes none): `num_nextn_predict_layers: 1` in
    config.json and, under `model.layers.{N}.` (N = num_hidden_layers), `enorm`, `hnorm`,
    `eh_proj` [hidden, 2 * hidden], a decoder layer with the names and shapes of layer
    `like_layer` (1: MLA and the experts), `shared_head.norm` and `shared_head.head` (a copy
    of `lm_head`, as DeepSeek's is), and `embed_tokens` only with `own_embedding`. Random
    values (norms around 1). Returns the tensors added."""
    from safetensors.torch import load_file, save_file

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed)

    def noise(shape, name: str) -> torch.Tensor:
        x = torch.randn(shape, generator=g)
        if "norm" in name:
            return 1.0 + 0.1 * x
        if name.endswith("e_score_correction_bias"):
            return 0.1 * x
        return x if "embed" in name else x * shape[-1] ** -0.5

    src, dst = f"model.layers.{like_layer}.", f"model.layers.{n}."
    added = {dst + name[len(src):]: noise(t.shape, name) for name, t in tensors.items()
             if name.startswith(src)}
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.norm.weight", (hidden,))):
        added[dst + name] = noise(shape, name)
    added[dst + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    if own_embedding:
        added[dst + "embed_tokens.weight"] = noise(tensors["model.embed_tokens.weight"].shape,
                                                   "embed_tokens")
    save_file({**tensors, **added}, str(path), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=1))
    return added


def reference_greedy(model, ids: list[int], steps: int) -> list[int]:
    """transformers' own greedy continuation of `ids` by `steps` tokens (no end of text), the
    tokens our engine must produce from the same weights."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                         eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()
