"""A DeepSeek-V2-Lite-shaped model with random weights, written as a `deepseek2` GGUF that
llama.cpp's server and ours both serve (issue 32's comparison): V2-Lite's real widths (hidden
2048, 16 heads, no q_lora, MLA with kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128;
64 routed experts of width 1408, 6 per token by V2's softmax greedy router, 2 shared experts;
a dense first layer of width 10944; YaRN as V2-Lite's config has it) with fewer layers than its
27, so that it fits a small machine: `--layers N` is one dense layer and N - 1 MoE layers.

The keys and tensors are llama.cpp's converter's (testkit/family_gguf.py's helpers write them:
kv_b_proj in the newer split form `attn_k_b` / `attn_v_b`, each layer's experts stacked as
`ffn_{gate,up,down}_exps`, the shared experts as `ffn_*_shexp`, the router `ffn_gate_inp` in
F32). Matrices are quantized one at a time by gguf's own quantizers (a stack of 64 experts is
the largest float array that ever exists); the vocabulary is bench/synthetic_gguf.py's (byte
symbols padded with plain ASCII tokens under a ChatML template), 32k tokens.

One key the converter never writes for V2-Lite: llama.cpp tells a model without q_lora by its
depth (27 or 26 layers, V2-Lite's and its kin's) and otherwise requires
`attention.q_lora_rank`; at other depths the file says `q_lora_rank = 0`, which both servers
read as "no q_lora" (a plain q_proj, `attn_q`).

    python -m bench.synthetic_deepseek OUT.gguf --layers 4 --type Q4_0
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np

from bench.synthetic_gguf import CHATML, MERGES, SPECIALS, _vocabulary
from testkit.family_gguf import (
    _add_deepseek_shape,
    _add_experts,
    _add_rope,
    _gguf_tensors,
    add_tensor,
)

FAMILY = "deepseek_v2_lite"  # testkit/family_gguf.py's name: softmax gating, no groups
# DeepSeek-V2-Lite's config.json, less its depth (27 layers) and its vocabulary (102,400)
V2_LITE: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 10944, "num_attention_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "vocab_size": 32000,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "mscale": 0.707,
                        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}
# the same structure at test size (every width a whole number of Q4_0/Q8_0 blocks)
TINY: dict[str, Any] = {
    **V2_LITE, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "vocab_size": 1000, "max_position_embeddings": 4096}
PRESETS = {"v2-lite": V2_LITE, "tiny": TINY}
LLAMA_CPP_LITE_DEPTHS = (26, 27)  # llama.cpp's deepseek2: no q_lora_rank key read
DEFAULT_LAYERS = {"v2-lite": 4, "tiny": 3}


def config(preset: str, layers: int) -> dict[str, Any]:
    """The model's `DeepseekV2Config` keyword arguments (transformers' names)."""
    if layers < 2:
        raise ValueError("--layers must be at least 2: the dense first layer and a MoE layer")
    return {**PRESETS[preset], "num_hidden_layers": layers, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}


def parameters(c: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, parameters a token reads), norms left out."""
    h, heads, rank = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    attn = h * heads * (nope + rope) + h * (rank + rope) + rank * heads * (nope + v) \
        + heads * v * h
    expert = 3 * h * c["moe_intermediate_size"]
    dense = c["first_k_dense_replace"]
    moe = c["num_hidden_layers"] - dense
    shared = c["n_shared_experts"] * expert + h * c["n_routed_experts"]
    base = c["num_hidden_layers"] * attn + dense * 3 * h * c["intermediate_size"] \
        + moe * shared + 2 * c["vocab_size"] * h
    return base + moe * c["n_routed_experts"] * expert, \
        base + moe * c["num_experts_per_tok"] * expert


def write(path: Path, c: dict[str, Any], kind: gguf.GGMLQuantizationType, seed: int = 0) -> None:
    cfg = SimpleNamespace(**c)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _add_deepseek_shape(writer, cfg, split_kv_b=True)
    if not cfg.q_lora_rank and cfg.num_hidden_layers not in LLAMA_CPP_LITE_DEPTHS:
        writer.add_q_lora_rank(0)  # llama.cpp requires the key at other depths (module text)
    _add_experts(writer, cfg, FAMILY)
    _add_rope(writer, cfg, FAMILY)
    _add_vocabulary(writer, c["vocab_size"])
    rng = np.random.default_rng(seed)
    F32 = gguf.GGMLQuantizationType.F32

    def matrix(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5

    def norm(name: str, width: int) -> None:
        add_tensor(writer, name, 1 + 0.1 * rng.standard_normal(width, dtype=np.float32), F32)

    def hf(name: str, shape: tuple[int, ...], kind=kind) -> None:
        """A Hugging Face tensor under the converter's name(s) (kv_b_proj becomes two)."""
        for gguf_name, part in _gguf_tensors(name, matrix(shape), cfg, True):
            add_tensor(writer, gguf_name, part, kind)

    h = cfg.hidden_size
    add_tensor(writer, "token_embd.weight", matrix((cfg.vocab_size, h)), kind)
    for i in range(cfg.num_hidden_layers):
        for name, shape in _attention(cfg):
            hf(f"model.layers.{i}.self_attn.{name}.weight", shape)
        norm(f"blk.{i}.attn_norm.weight", h)
        norm(f"blk.{i}.attn_kv_a_norm.weight", cfg.kv_lora_rank)
        norm(f"blk.{i}.ffn_norm.weight", h)
        if i < cfg.first_k_dense_replace:
            _mlp(hf, f"model.layers.{i}.mlp.", h, cfg.intermediate_size)
        else:
            _experts(writer, matrix, cfg, i, kind)
            hf(f"model.layers.{i}.mlp.gate.weight", (cfg.n_routed_experts, h), F32)
            _mlp(hf, f"model.layers.{i}.mlp.shared_experts.", h,
                 cfg.n_shared_experts * cfg.moe_intermediate_size)
    norm("output_norm.weight", h)
    add_tensor(writer, "output.weight", matrix((cfg.vocab_size, h)), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _attention(cfg) -> list[tuple[str, tuple[int, int]]]:
    """MLA's matrices without q_lora, [out, in] in transformers' names."""
    heads, rank, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, h = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.hidden_size
    return [("q_proj", (heads * (nope + rope), h)), ("kv_a_proj_with_mqa", (rank + rope, h)),
            ("kv_b_proj", (heads * (nope + v), rank)), ("o_proj", (h, heads * v))]


def _mlp(hf, prefix: str, hidden: int, width: int) -> None:
    hf(prefix + "gate_proj.weight", (width, hidden))
    hf(prefix + "up_proj.weight", (width, hidden))
    hf(prefix + "down_proj.weight", (hidden, width))


def _experts(writer: gguf.GGUFWriter, matrix, cfg, layer: int,
             kind: gguf.GGMLQuantizationType) -> None:
    """The routed experts as the converter stacks them: one [E, N, K] tensor a projection."""
    e, width, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for proj, shape in (("gate", (e, width, h)), ("up", (e, width, h)), ("down", (e, h, width))):
        add_tensor(writer, f"blk.{layer}.ffn_{proj}_exps.weight", matrix(shape), kind)


def _add_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """bench/synthetic_gguf.py's vocabulary and chat template."""
    tokens = _vocabulary(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)


def ensure(path: Path, preset: str, layers: int, kind_name: str) -> Path:
    """The file at `path`, written first where it is missing (minutes at V2-Lite's widths)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        start = time.perf_counter()
        c = config(preset, layers)
        write(partial, c, gguf.GGMLQuantizationType[kind_name])
        partial.rename(path)
        total, active = parameters(c)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {total / 1e9:.2f}e9 "
              f"parameters, {active / 1e9:.2f}e9 read a token) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic_deepseek", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="v2-lite", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers: 1 dense + N-1 MoE (default: v2-lite 4, tiny 3)")
    p.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0", "F16"))
    a = p.parse_args(argv)
    ensure(a.out, a.preset, a.layers or DEFAULT_LAYERS[a.preset], a.type)


if __name__ == "__main__":
    main()
