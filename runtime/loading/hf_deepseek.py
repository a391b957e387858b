"""What a DeepSeek-V2/V3 Hugging Face folder needs beyond the other families: its Multi-head
Latent Attention keys read into ModelConfig, the rows making the rotated query/key parts
permuted from DeepSeek's interleaved pairs to the halves our rotary kernel rotates, and the
multi-token-prediction layer's tensors skipped unless `--spec mtp` drafts with them
(runtime/loading/hf.py calls these)."""
from __future__ import annotations

import logging

import torch

from contract.config import ModelConfig
from runtime.loading.rope_rows import latent_rows_in_halves, query_rows_in_halves

log = logging.getLogger("runtime.startup")

LATENT_ATTENTION_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
# config keys of DeepSeek attention variants we do not implement (V3.2's sparse attention
# indexer): a folder with them is refused, not served as plain MLA
_UNSERVED_MLA_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


def latent_attention_traits(arch: str, raw: dict) -> dict:
    """The Multi-head Latent Attention fields of ModelConfig ({} for other families); a
    DeepSeek config without its MLA keys, or with a variant's we do not implement, is
    refused by name."""
    if arch not in LATENT_ATTENTION_ARCHITECTURES:
        return {}
    unserved = [k for k in _UNSERVED_MLA_KEYS if raw.get(k)]
    if unserved:
        raise ValueError(f"DeepSeek attention with {', '.join(unserved)} (sparse attention) "
                         "is not served")
    if not raw.get("kv_lora_rank"):
        raise ValueError("kv_lora_rank is missing (a DeepSeek model without latent attention "
                         "is not served)")
    return {"kv_lora_rank": int(raw["kv_lora_rank"]),
            "q_lora_rank": int(raw.get("q_lora_rank") or 0),
            "qk_nope_head_dim": int(raw["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(raw["qk_rope_head_dim"]),
            "v_head_dim": int(raw["v_head_dim"])}


def rope_halves(weights: dict[str, torch.Tensor], config: ModelConfig,
                mtp_layers: int = 0) -> None:
    """Every layer's rotated query and key rows from DeepSeek's interleaved pairs to the halves
    our rotary kernel rotates (runtime/loading/rope_rows.py), the MTP layers' too."""
    for i in range(config.num_hidden_layers + mtp_layers):
        a = f"model.layers.{i}.self_attn."
        q = a + ("q_b_proj.weight" if config.q_lora_rank else "q_proj.weight")
        for name in (q, q.removesuffix("weight") + "bias"):
            if name in weights:
                weights[name] = query_rows_in_halves(weights[name], config)
        for name in (a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj_with_mqa.bias"):
            if name in weights:
                weights[name] = latent_rows_in_halves(weights[name], config)


def rope_interleaved(arch: str, raw: dict) -> bool:
    """Whether the checkpoint rotates interleaved pairs: DeepSeek-V2 always (its reference
    rotates complex pairs and reads no key for it), V3 unless `rope_interleave` is false."""
    return arch == "deepseek_v2" or bool(raw.get("rope_interleave", True))


def skip_mtp_layers(weights: dict[str, torch.Tensor], config: ModelConfig,
                     mtp_layers: int) -> None:
    """Drop the multi-token-prediction layers' tensors (DeepSeek-V3 numbers them after the
    decoder's: model.layers.61.* of 61 layers), with a log line: only `--spec mtp` uses them."""
    if not mtp_layers:
        return
    n = config.num_hidden_layers
    prefixes = tuple(f"model.layers.{n + i}." for i in range(mtp_layers))
    dropped = [name for name in weights if name.startswith(prefixes)]
    for name in dropped:
        del weights[name]
    if dropped:
        log.info("skipped %d tensors of %d multi-token-prediction layer(s) (%s*): only "
                 "--spec mtp drafts with them", len(dropped), mtp_layers, prefixes[0])
