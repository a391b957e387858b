"""Read a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek) have their MoE fields and
expert tensor names from runtime/loading/hf_experts.py; DeepSeek-V2/V3's Multi-head Latent
Attention keys, rotated rows and multi-token-prediction layers from
runtime/loading/hf_deepseek.py; block-scaled FP8 weights (DeepSeek-V3/R1 as shipped) are
dequantized at load (runtime/loading/fp8.py)."""
from __future__ import annotations

import glob
import logging
import os

import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.json_files import read_json
from contract.rope import RopeScalingError, rope_from_hf
from contract.tokenizer import Tokenizer
from runtime.loading.fp8 import FP8Error, dequantize_checkpoint
from runtime.loading.hf_deepseek import (
    latent_attention_traits,
    rope_halves,
    rope_interleaved,
    skip_mtp_layers,
)
from runtime.loading.hf_experts import expert_names, expert_tensors, moe_traits

log = logging.getLogger("runtime.startup")

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# config.json's activation names for the MLP gate, as ModelConfig.hidden_act names them
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def read_hf_folder(folder: str, keep_mtp: bool = False
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights (HF names) and tokenizer of a folder saved by `save_pretrained`.
    `keep_mtp`: keep the multi-token-prediction layers' tensors (`--spec mtp` drafts with them,
    runtime/models/mtp.py), else they are skipped."""
    raw = read_json(os.path.join(folder, "config.json"), required=True)
    generation = read_json(os.path.join(folder, "generation_config.json"), required=False)
    extra_eos = _id_list(generation.get("eos_token_id")) + _id_list(raw.get("eos_token_id"))
    tokenizer = Tokenizer.from_hf_folder(folder, extra_eos_ids=tuple(extra_eos))
    config = config_from_hf(raw, folder)
    weights = read_safetensors(folder)
    mtp_layers = int(raw.get("num_nextn_predict_layers") or 0)
    if config.is_latent_attention and not keep_mtp:  # before dequantizing: not needed
        skip_mtp_layers(weights, config, mtp_layers)
    quantization = raw.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") != "fp8":
        raise ModelLoadError(f"{folder}: quantization_config quant_method "
                             f"{quantization.get('quant_method')!r} is not served")
    try:
        dequantize_checkpoint(weights, quantization)
    except FP8Error as e:
        raise ModelLoadError(f"{folder}: {e}") from e
    if config.is_latent_attention and rope_interleaved(config.architecture, raw):
        rope_halves(weights, config, mtp_layers if keep_mtp else 0)  # after dequantizing
    if config.num_experts:
        weights = expert_names(weights)
    _check_weights(config, weights, folder)
    if config.architecture == "gemma3":  # its norms multiply by (1 + w): stored as that
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name] + 1.0
    return config, weights, tokenizer


def config_from_hf(raw: dict, folder: str = "") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{folder}: unsupported architectures {archs} "
                             f"(supported: {sorted(ARCHITECTURES)})")
    try:
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        global_rope, local_rope = _rope_settings(raw)
        latent = latent_attention_traits(arch, raw)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if latent else int(raw.get("num_key_value_heads")
                                                         or heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(global_rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", raw.get(
                "qkv_bias", arch in ("qwen2", "qwen2_moe")))),
            head_dim=latent.get("qk_rope_head_dim", raw.get("head_dim")),
            bos_token_id=raw.get("bos_token_id"),
            # DeepSeek's block-scaled fp8 (dequantized at load): informational, served float
            # unless a quantization is asked for
            weight_format="fp8" if (raw.get("quantization_config") or {}).get(
                "quant_method") == "fp8" else "float",
            rope_scaling=rope_from_hf(global_rope,
                                      int(raw.get("max_position_embeddings", 2048))),
            **_family_traits(arch, raw, layers, local_rope),
            **moe_traits(arch, raw, layers),
            **latent,
        )
    except RopeScalingError as e:
        raise ModelLoadError(f"{folder}/config.json: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: bad or missing field: {e}") from e


def _rope_settings(raw: dict) -> tuple[dict, dict | None]:
    """(the global layers' rope dict, the windowed layers' or None) in either config form:
    transformers >= 5 nests them in `rope_parameters` (by layer type where they differ),
    older configs keep `rope_theta`, `rope_scaling` and Gemma's `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return params.get("full_attention") or {}, params.get("sliding_attention")
    rope = dict(params or raw.get("rope_scaling") or {})
    if "rope_theta" in raw:
        rope.setdefault("rope_theta", raw["rope_theta"])
    local = raw.get("rope_local_base_freq")
    return rope, ({"rope_type": "default", "rope_theta": local} if local else None)


def _family_traits(arch: str, raw: dict, layers: int, local_rope: dict | None) -> dict:
    """The ModelConfig fields beyond Llama's that a config.json implies; what we do not
    implement (another activation, partial rotary, attention soft-capping) is refused."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in HIDDEN_ACTS:
        raise ValueError(f"hidden activation {act!r} is not served")
    if float(raw.get("partial_rotary_factor") or
             (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not served")
    if raw.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping is not served")
    traits: dict = {"hidden_act": HIDDEN_ACTS[act], "layer_windows": _windows(raw, layers)}
    if arch in ("qwen3", "qwen3_moe", "gemma3"):
        traits["qk_norm"] = True
    if arch == "gemma3":
        traits.update(sandwich_norms=True, embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
                      query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                      final_logit_softcapping=raw.get("final_logit_softcapping"))
    if local_rope is not None and traits["layer_windows"]:
        if (local_rope.get("rope_type") or "default") != "default":
            raise ValueError(f"windowed layers' rope {local_rope} is not served")
        traits["rope_local_theta"] = float(local_rope["rope_theta"])
    return traits


def _windows(raw: dict, layers: int) -> tuple[int, ...]:
    """Each layer's attention window (0: global), () when no layer has one."""
    window = int(raw.get("sliding_window") or 0)
    if not window or raw.get("use_sliding_window") is False:
        return ()
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        types = ["full_attention" if pattern and (i + 1) % int(pattern) == 0
                 else "sliding_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"{len(types)} layer_types for {layers} layers")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


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
        # fp8 stays as it is until its scales are applied (runtime/loading/fp8.py)
        weights.update((k, v if v.dtype in _FP8 else v.float().contiguous())
                       for k, v in shard.items())
    return weights


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_weights(config: ModelConfig, weights: dict, folder: str) -> None:
    """Fail at load time, naming the tensor, rather than at the first forward pass."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        needed += [p + n + ".weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.o_proj")]
        if config.is_latent_attention:
            a = p + "self_attn."
            needed += [a + n + ".weight" for n in (
                "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")]
            needed += [a + n + ".weight" for n in (
                ("q_a_proj", "q_a_layernorm", "q_b_proj") if config.q_lora_rank
                else ("q_proj",))]
        elif p + "self_attn.qkv_proj.weight" not in weights:
            needed += [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        if config.is_moe_layer(i):
            needed += expert_tensors(config, p + "mlp.", weights)
        elif p + "mlp.gate_up_proj.weight" not in weights:
            needed += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                       p + "mlp.down_proj.weight"]
        else:
            needed.append(p + "mlp.down_proj.weight")
        if config.qk_norm:
            needed += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.sandwich_norms:
            needed += [p + "pre_feedforward_layernorm.weight",
                       p + "post_feedforward_layernorm.weight"]
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


