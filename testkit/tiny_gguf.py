"""The header of a tiny llama GGUF, written with the `gguf` package's own writer: shape keys,
norm epsilon and a byte-level vocabulary. Tests that need a GGUF of some tensor types start
from it and add their tensors (tests/runtime/test_gguf_blocks.py, test_kquant_loading.py)."""
from __future__ import annotations

import gguf


def llama_writer(path: str, vocab: tuple[list[str], list[str]], *, layers: int, hidden: int,
                 ffn: int, heads: int, kv_heads: int) -> gguf.GGUFWriter:
    """A writer for `path` with a llama model's keys and the vocabulary (tokens, merges),
    BOS 1 and EOS 2; the caller adds tensors and writes the file."""
    tokens, merges = vocab
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", layers), ("context_length", 256),
                       ("embedding_length", hidden), ("feed_forward_length", ffn),
                       ("head_count", heads), ("head_count_kv", kv_heads)]:
        getattr(writer, "add_" + add)(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer
