"""Read a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer."""
from __future__ import annotations

import glob
import os

import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.json_files import read_json
from contract.tokenizer import Tokenizer

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def read_hf_folder(folder: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights (HF names) and tokenizer of a folder saved by `save_pretrained`."""
    raw = read_json(os.path.join(folder, "config.json"), required=True)
    generation = read_json(os.path.join(folder, "generation_config.json"), required=False)
    extra_eos = _id_list(generation.get("eos_token_id")) + _id_list(raw.get("eos_token_id"))
    tokenizer = Tokenizer.from_hf_folder(folder, extra_eos_ids=tuple(extra_eos))
    config = config_from_hf(raw, folder)
    weights = read_safetensors(folder)
    _check_weights(config, weights, folder)
    return config, weights, tokenizer


def config_from_hf(raw: dict, folder: str = "") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{folder}: unsupported architectures {archs} "
                             f"(supported: {sorted(ARCHITECTURES)})")
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
    scaling = raw.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ModelLoadError(f"{folder}: unsupported rope scaling {scaling}")
    try:
        heads = int(raw["num_attention_heads"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            head_dim=raw.get("head_dim"),
            bos_token_id=raw.get("bos_token_id"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: bad or missing field: {e}") from e


def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            shard = load_file(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: unreadable safetensors: {e}") from e
        weights.update((k, v.float().contiguous()) for k, v in shard.items())
    return weights


def _check_weights(config: ModelConfig, weights: dict, folder: str) -> None:
    """Fail at load time, naming the tensor, rather than at the first forward pass."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        needed += [f"model.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ModelLoadError(f"{folder}: missing tensors {missing[:5]}"
                             f"{' and more' if len(missing) > 5 else ''}")
    if config.tie_word_embeddings:  # one convention for callers: tied => no lm_head entry
        weights.pop("lm_head.weight", None)


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


