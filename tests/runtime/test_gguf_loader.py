"""GGUF reading: a tiny file written with gguf.GGUFWriter, broken files, and the real SmolLM2."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from contract.errors import ModelLoadError
from runtime.loading.gguf import read_gguf, read_header
from runtime.loading.loader import default_model_path

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# one tensor kind per GGUF type we support, so every dequantizer runs on its own layout
LAYER_TYPES = {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
               "ffn_gate": Q.Q5_0, "ffn_up": Q.BF16, "ffn_down": Q.Q8_0}
TOLERANCE = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q5_0: 0.1, Q.Q4_0: 0.2,
             Q.Q4_1: 0.2}


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """Control tokens, GPT-2's 256 byte symbols, and a few merges ('Ġ t', 'Ġt h', ...)."""
    from contract.tokenizer import _byte_decoder

    symbols = sorted(_byte_decoder(), key=_byte_decoder().get)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    return CONTROL + symbols + [m.replace(" ", "") for m in merges], merges


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows (so the loader must undo it)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shape(name: str) -> tuple[int, int]:
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}[name]


def _add(writer, name: str, w: np.ndarray, kind) -> np.ndarray:
    """Write `w` as `kind`; return what an exact reader must get back."""
    if kind == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
        return w.astype(np.float32)
    if kind == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
        return w.astype(np.float16).astype(np.float32)
    packed = quantize(w, kind)
    writer.add_tensor(name, packed, raw_dtype=kind)
    return dequantize(packed, kind)


def write_tiny_gguf(path: str, tied: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF with a byte-level tokenizer; returns the expected HF-named weights."""
    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    vocab = len(tokens)
    expected["model.embed_tokens.weight"] = _add(
        writer, "token_embd.weight", rng.standard_normal((vocab, HIDDEN), np.float32), Q.Q8_0)
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        expected[pre + "input_layernorm.weight"] = _add(
            writer, f"blk.{i}.attn_norm.weight", rng.random(HIDDEN, np.float32), Q.F32)
        expected[pre + "post_attention_layernorm.weight"] = _add(
            writer, f"blk.{i}.ffn_norm.weight", rng.random(HIDDEN, np.float32), Q.F32)
        for short, kind in LAYER_TYPES.items():
            w = rng.standard_normal(_shape(short), np.float32)
            hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}[short]
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(short)
            stored = permute_like_llama_cpp(w, heads) if heads else w
            got = _add(writer, f"blk.{i}.{short}.weight", stored, kind)
            # the loader must return HF layout: undo the permute on what the file holds
            expected[pre + hf + ".weight"] = (_unpermute_np(got, heads) if heads else got)
            expected.setdefault("_original." + pre + hf, w)
            expected.setdefault("_kind." + pre + hf, kind)
    expected["model.norm.weight"] = _add(writer, "output_norm.weight",
                                         rng.random(HIDDEN, np.float32), Q.F32)
    if not tied:
        expected["lm_head.weight"] = _add(
            writer, "output.weight", rng.standard_normal((vocab, HIDDEN), np.float32), Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _unpermute_np(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(expected: dict) -> dict[str, np.ndarray]:
    return {k: v for k, v in expected.items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")
    return path, write_tiny_gguf(path)


def test_tiny_config(tiny):
    config, _, tokenizer = read_gguf(tiny[0])
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.intermediate_size == FFN and config.max_position_embeddings == 256
    assert config.rope_theta == 50000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.vocab_size == tokenizer.vocab_size == len(byte_level_vocab()[0])
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_tiny_weights_names_shapes_and_values(tiny):
    _, weights, _ = read_gguf(tiny[0])
    expected = hf_weights(tiny[1])
    assert set(weights) == set(expected)  # tied: no lm_head
    for name, want in expected.items():
        got = weights[name]
        assert got.dtype == torch.float32 and got.is_contiguous()
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def test_tiny_dequant_close_to_original_and_unpermuted(tiny):
    """Against the weights before quantization: checks the unpermute independently of the lib."""
    _, weights, _ = read_gguf(tiny[0])
    for key, original in tiny[1].items():
        if key.startswith("_original."):
            name = key.removeprefix("_original.")
            kind = tiny[1]["_kind." + name]
            got = weights[name + ".weight"].numpy()
            assert np.abs(got - original).max() <= TOLERANCE[kind] * np.abs(original).max(), name


def test_untied_has_lm_head(tmp_path):
    path = str(tmp_path / "untied.gguf")
    expected = write_tiny_gguf(path, tied=False)
    config, weights, _ = read_gguf(path)
    assert not config.tie_word_embeddings
    np.testing.assert_array_equal(weights["lm_head.weight"].numpy(), expected["lm_head.weight"])


def test_truncated_file(tiny, tmp_path):
    with open(tiny[0], "rb") as f:
        data = f.read()
    for cut in (3, 40, len(data) // 50, len(data) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf"):
            read_gguf(str(path))


def test_random_bytes_and_missing_file(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelLoadError, match="noise.gguf.*magic"):
        read_gguf(str(path))
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        read_gguf(str(tmp_path / "absent.gguf"))


def test_unsupported_quant_type(tmp_path):
    path = str(tmp_path / "tq2.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("head_count", 4)]:
        getattr(writer, "add_" + add)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(byte_level_vocab()[0])
    writer.add_token_merges([])
    # TQ2_0 (ternary): 256 values in 66 bytes; meaningless bytes, the loader must refuse
    writer.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_dtype=Q.TQ2_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors = read_header(path)
    assert tensors[0].shape == (4, 256)
    with pytest.raises(ModelLoadError, match="tq2.gguf.*TQ2_0"):
        read_gguf(path)


# the real model


@pytest.fixture(scope="module")
def smollm():
    return read_gguf(default_model_path())


@pytest.fixture(scope="module")
def transformers_state(hf_smollm):
    """transformers' own GGUF loading of the same file: the independent reference."""
    return hf_smollm.state_dict()


@pytest.mark.model
def test_smollm_config(smollm):
    config, weights, tokenizer = smollm
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.intermediate_size, config.vocab_size) == (1536, 49152)
    assert (config.max_position_embeddings, config.rope_theta) == (8192, 100000.0)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert len(weights) == 2 + 9 * 30
    assert tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1


@pytest.mark.model
@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight", "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.17.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
    "model.layers.5.self_attn.v_proj.weight", "model.layers.5.self_attn.o_proj.weight",
    "model.layers.12.mlp.gate_proj.weight", "model.layers.12.mlp.down_proj.weight",
    "model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
])
def test_smollm_matches_transformers(smollm, transformers_state, name):
    ours, theirs = smollm[1][name], transformers_state[name]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)
