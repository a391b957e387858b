"""A tiny random-weight Llama checkpoint written as a Hugging Face folder.

It goes through exactly the loading and serving code of a real checkpoint (config.json,
safetensors, tokenizer.json with a chat template), but runs a step in milliseconds. The test
suite's `tiny_model_dir` fixture and `bench/engine_cuda.py` (SmolLM2's shape with random
weights) both build theirs here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 and prices like $3.50.",
    "Caching the prefix of a prompt saves compute for every request that repeats it.",
    "Unicode: café, naïve, 東京, 😀 emoji and — dashes.",
] * 20


def build_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tiny_checkpoint(folder: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                          kv_heads: int = 2, intermediate: int = 128, max_len: int = 512,
                          seed: int = 0, tied: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied, "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": eos, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "add_bos_token": False}))
    save_file(random_weights(config, seed), str(folder / "model.safetensors"))
    return folder


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def rand(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h, scale=1.0),
         "model.norm.weight": 1 + 0.1 * rand(h, scale=1.0)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + 0.1 * rand(h, scale=1.0),
            p + "post_attention_layernorm.weight": 1 + 0.1 * rand(h, scale=1.0),
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    return w
