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
through `mlp_only_layers`), qwen2_moe (un-normalised, a gated shared expert).
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
FAMILIES = (*ROPE, "qwen3", "phi3", "gemma3", *MOE_FAMILIES)


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
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def _model_class(family: str):
    import transformers

    return {"qwen3": transformers.Qwen3ForCausalLM, "phi3": transformers.Phi3ForCausalLM,
            "gemma3": transformers.Gemma3ForCausalLM,
            "mixtral": transformers.MixtralForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "qwen2_moe": transformers.Qwen2MoeForCausalLM}.get(family,
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
