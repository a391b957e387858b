"""A Llama-shaped model of any size with random weights, written as a GGUF that llama.cpp's
server and ours both serve (issue 31's 3B comparison): llama.cpp's tensor names and keys, Q4_0
or Q8_0 matrices quantized by gguf's own quantizers, one tensor at a time (a 3B model never
exists in float32 in memory), and a byte-level vocabulary padded with plain ASCII tokens
(" w123": random weights generate them, and every one decodes to whole characters, so both
servers stream one chunk per token) under a ChatML template.

    python -m bench.synthetic_gguf OUT.gguf --preset 3b --type Q4_0
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np

from testkit.family_gguf import add_tensor

# Llama 3.2 3B's shape with a 32k vocabulary: 3.0e9 parameters
PRESETS = {"3b": {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192,
                  "vocab": 32000},
           "tiny": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 512,
                    "vocab": 1000}}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a few byte-pair merges: llama.cpp refuses a BPE vocabulary without any
MERGES = ["Ġ t", "h e", "i n", "Ġ a", "Ġt he"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def parameters(shape: dict) -> int:
    h, f, kv = shape["hidden"], shape["ffn"], shape["kv_heads"] * shape["hidden"] \
        // shape["heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return shape["layers"] * layer + 2 * shape["vocab"] * h + h


def _vocabulary(size: int) -> list[str]:
    from contract.tokenizer import _byte_decoder

    symbols = sorted(_byte_decoder(), key=_byte_decoder().get)  # GPT-2's 256 byte symbols
    merged = [m.replace(" ", "") for m in MERGES]
    plain = [f"Ġw{i}" for i in range(size - len(SPECIALS) - len(symbols) - len(merged))]
    return SPECIALS + symbols + merged + plain


def write(path: Path, shape: dict, kind: gguf.GGMLQuantizationType, seed: int = 0) -> None:
    h, heads, kv_heads = shape["hidden"], shape["heads"], shape["kv_heads"]
    head_dim, ffn, vocab = h // heads, shape["ffn"], shape["vocab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    tokens = _vocabulary(vocab)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int) -> None:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5
        add_tensor(writer, name, w, kind)

    def norm(name: str) -> None:
        add_tensor(writer, name, 1 + 0.1 * rng.standard_normal(h, dtype=np.float32), kind)

    matrix("token_embd.weight", vocab, h)
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        norm(b + "ffn_norm.weight")
        for name, rows, cols in [("attn_q", h, h), ("attn_k", kv_heads * head_dim, h),
                                 ("attn_v", kv_heads * head_dim, h), ("attn_output", h, h),
                                 ("ffn_gate", ffn, h), ("ffn_up", ffn, h),
                                 ("ffn_down", h, ffn)]:
            matrix(b + name + ".weight", rows, cols)
    norm("output_norm.weight")
    matrix("output.weight", vocab, h)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ensure(path: Path, preset: str, kind_name: str) -> Path:
    """The file at `path`, written first where it is missing (minutes for 3B)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        start = time.perf_counter()
        write(partial, PRESETS[preset], gguf.GGMLQuantizationType[kind_name])
        partial.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, "
              f"{parameters(PRESETS[preset]) / 1e9:.2f}e9 parameters) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="3b", choices=sorted(PRESETS))
    p.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0", "F16"))
    a = p.parse_args(argv)
    ensure(a.out, a.preset, a.type)


if __name__ == "__main__":
    main()
