"""Read a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) have their expert tensors put under
one set of names, the Hub's Qwen form `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`
and `mlp.gate.weight`: Mixtral's `block_sparse_moe.experts.E.w1/w3/w2` are renamed, and the
stacked 3-D tensors transformers 5 holds in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), should a folder have them, are split per expert (views).

DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) attend with Multi-head Latent
Attention (runtime/models/mla.py): their MLA keys are read here, their block-scaled FP8 weights
(DeepSeek-V3/R1 as shipped) dequantized at load (runtime/loading/fp8.py), the rows making the
rotated query/key parts permuted from DeepSeek's interleaved pairs to the halves our rotary
kernel rotates (`rope_halves`), and the multi-token-prediction layer's tensors
(`num_nextn_predict_layers`) kept for `--spec mtp` (runtime/models/mtp.py), else skipped by
name with a log line."""
from __future__ import annotations

import glob
import logging
import os
import re

import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.json_files import read_json
from contract.rope import RopeScalingError, rope_from_hf
from contract.tokenizer import Tokenizer
from runtime.loading.fp8 import FP8Error, dequantize_checkpoint

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
LATENT_ATTENTION_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
# config keys of DeepSeek attention variants we do not implement (V3.2's sparse attention
# indexer): a folder with them is refused, not served as plain MLA
_UNSERVED_MLA_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
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
        _skip_mtp_layers(weights, config, mtp_layers)
    quantization = raw.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") != "fp8":
        raise ModelLoadError(f"{folder}: quantization_config quant_method "
                             f"{quantization.get('quant_method')!r} is not served")
    try:
        dequantize_checkpoint(weights, quantization)
    except FP8Error as e:
        raise ModelLoadError(f"{folder}: {e}") from e
    if config.is_latent_attention and _rope_interleaved(config.architecture, raw):
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
    """DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of each rotated part; our
    rotary kernel rotates halves (x_i with x_{i + d/2}). Permuting the rows that make each
    rotated part to [x0, x2, ... | x1, x3, ...] (the query's per head, the shared key's once)
    makes one rotation the other, and both q and k get it, so every q . k is unchanged."""
    rope, nope, rank = config.qk_rope_head_dim, config.qk_nope_head_dim, config.kv_lora_rank
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    heads = config.num_attention_heads
    for i in range(config.num_hidden_layers + mtp_layers):  # the MTP layers' attention too
        a = f"model.layers.{i}.self_attn."
        q = a + ("q_b_proj.weight" if config.q_lora_rank else "q_proj.weight")
        for name in (q, q.removesuffix("weight") + "bias"):
            if name in weights:
                t = weights[name]
                per_head = t.reshape(heads, nope + rope, *t.shape[1:]).clone()
                per_head[:, nope:] = per_head[:, nope:][:, perm]
                weights[name] = per_head.reshape(t.shape)
        for name in (a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj_with_mqa.bias"):
            if name in weights:
                t = weights[name].clone()
                t[rank:] = t[rank:][perm]
                weights[name] = t


def _rope_interleaved(arch: str, raw: dict) -> bool:
    """Whether the checkpoint rotates interleaved pairs: DeepSeek-V2 always (its reference
    rotates complex pairs and reads no key for it), V3 unless `rope_interleave` is false."""
    return arch == "deepseek_v2" or bool(raw.get("rope_interleave", True))


def _skip_mtp_layers(weights: dict[str, torch.Tensor], config: ModelConfig,
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
            needed += _expert_tensors(config, p + "mlp.", weights)
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


def _expert_tensors(config: ModelConfig, m: str, weights: dict) -> list[str]:
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


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


