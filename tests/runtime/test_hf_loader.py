"""Hugging Face folders: config.json + (sharded) safetensors + tokenizer.json (+ configs)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from contract.errors import ModelLoadError
from contract.tokenizer import Tokenizer
from runtime.loading.gguf import read_gguf, read_gguf_tokenizer
from runtime.loading.loader import default_model_path, load_checkpoint
from tests.runtime.test_gguf_loader import CHAT_TEMPLATE, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-src") / "tiny.gguf")
    write_tiny_gguf(path)
    return read_gguf(path)


def hf_config(config, arch="LlamaForCausalLM", **extra) -> dict:
    return {"architectures": [arch], "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, **extra}


def write_folder(folder, tiny, *, config=None, shards=1, weights=None, dtype=torch.float32,
                 generation=None) -> str:
    """A save_pretrained-like folder from the tiny GGUF's weights and tokenizer."""
    cfg, w, tok = tiny
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config or hf_config(cfg), f)
    tok.backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
                   "bos_token": {"content": "<|im_start|>"}, "add_bos_token": False}, f)
    if generation is not None:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    names = sorted(weights if weights is not None else w)
    tensors = weights if weights is not None else w
    for i in range(shards):
        part = {n: tensors[n].to(dtype) for n in names[i::shards]}
        save_file(part, os.path.join(folder, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return str(folder)


def test_llama_folder_round_trip(tiny_gguf, tmp_path):
    folder = write_folder(tmp_path / "tiny-hf", tiny_gguf, shards=3,
                          generation={"eos_token_id": [2, 0]})
    ckpt = load_checkpoint(folder)
    cfg, weights, tok = tiny_gguf
    assert ckpt.config.name == "tiny-hf"
    assert ckpt.config.architecture == "llama" and ckpt.config.tie_word_embeddings
    assert ckpt.config.rope_theta == 50000.0 and ckpt.config.head_dim == cfg.head_dim
    assert ckpt.config.eos_token_ids == (2, 0) and ckpt.config.bos_token_id == 1
    assert ckpt.weights.keys() == weights.keys()
    for name, w in weights.items():
        assert ckpt.weights[name].dtype == torch.float32 and torch.equal(ckpt.weights[name], w)
    text = "<|im_start|>user\nHi 🙂 12<|im_end|>"
    assert ckpt.tokenizer.encode(text) == tok.encode(text)
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_qwen2_biases_and_bf16(tiny_gguf, tmp_path):
    cfg, weights, _ = tiny_gguf
    with_bias = dict(weights)
    for i in range(cfg.num_hidden_layers):
        for proj in ("q", "k", "v"):
            rows = weights[f"model.layers.{i}.self_attn.{proj}_proj.weight"].shape[0]
            with_bias[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.arange(rows) / 8
    folder = write_folder(tmp_path / "qwen", tiny_gguf, weights=with_bias, dtype=torch.bfloat16,
                          config=hf_config(cfg, "Qwen2ForCausalLM", tie_word_embeddings=False))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):  # untied needs its own head
        load_checkpoint(folder)
    with_bias["lm_head.weight"] = weights["model.embed_tokens.weight"]
    folder = write_folder(tmp_path / "qwen2", tiny_gguf, weights=with_bias, dtype=torch.bfloat16,
                          config=hf_config(cfg, "Qwen2ForCausalLM", tie_word_embeddings=False))
    ckpt = load_checkpoint(folder)
    assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias
    bias = ckpt.weights["model.layers.1.self_attn.k_proj.bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.arange(bias.numel()) / 8)


def test_mistral_and_transformers5_rope_parameters(tiny_gguf, tmp_path):
    cfg = hf_config(tiny_gguf[0], "MistralForCausalLM", rope_parameters={"rope_theta": 1e6,
                                                                         "rope_type": "default"})
    del cfg["rope_theta"]
    ckpt = load_checkpoint(write_folder(tmp_path / "mistral", tiny_gguf, config=cfg))
    assert ckpt.config.architecture == "mistral" and ckpt.config.rope_theta == 1e6


@pytest.mark.parametrize("breakage, message", [
    ("arch", "unsupported architectures"), ("rope", "rope scaling"), ("config", "config.json"),
    ("json", "config.json"), ("tokenizer", "tokenizer.json"), ("weights", "safetensors"),
    ("tensor", "missing tensors"),
])
def test_broken_folders(tiny_gguf, tmp_path, breakage, message):
    folder = write_folder(tmp_path / "broken", tiny_gguf)
    cfg = hf_config(tiny_gguf[0])
    if breakage == "arch":
        cfg["architectures"] = ["GPT2LMHeadModel"]
    if breakage == "rope":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    if breakage in ("arch", "rope"):
        write_folder(folder, tiny_gguf, config=cfg)
    elif breakage == "config":
        os.remove(os.path.join(folder, "config.json"))
    elif breakage == "json":
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{not json")
    elif breakage == "tokenizer":
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")
    elif breakage == "weights":
        path = os.path.join(folder, "model-00001-of-00001.safetensors")
        with open(path, "r+b") as f:
            f.truncate(100)
    elif breakage == "tensor":
        weights = dict(tiny_gguf[1])
        del weights["model.layers.1.mlp.up_proj.weight"]
        write_folder(folder, tiny_gguf, weights=weights)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(folder)


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint("/nonexistent/model")


@pytest.mark.model
def test_smollm_tokenizer_saved_as_tokenizer_json(tmp_path):
    """The GGUF-built SmolLM2 tokenizer survives tokenizer.json: same ids on mixed text."""
    tok = read_gguf_tokenizer(default_model_path())
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": tok.chat_template, "eos_token": "<|im_end|>"}, f)
    again = Tokenizer.from_hf_folder(str(tmp_path))
    text = "Héllo 🙂 12345 ①② <|im_start|>user\ndef f(x): return x<|im_end|>"
    assert again.encode(text) == tok.encode(text) and again.eos_token_ids == (2,)
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
