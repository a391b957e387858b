"""`python -m runtime.spec_decode.make_draft --layers L --out DIR [--model PATH]`: a draft
model made of the target's first L layers (plus its embeddings, final norm and LM head),
saved as a Hugging Face folder that `--spec draft:DIR` loads like any other model."""
from __future__ import annotations

import argparse
import json
import os
import sys

from safetensors.torch import save_file

from runtime.loading.loader import Checkpoint, load_checkpoint

ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM"}


def write_draft(ck: Checkpoint, num_layers: int, out: str) -> str:
    cfg = ck.config
    if not 0 < num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {cfg.num_hidden_layers}]")
    os.makedirs(out, exist_ok=True)
    keep = {k: v.contiguous() for k, v in ck.weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, os.path.join(out, "model.safetensors"))
    config = {"architectures": [ARCH_NAMES[cfg.architecture]], "model_type": cfg.architecture,
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": num_layers,
              "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.max_position_embeddings,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
              "tie_word_embeddings": cfg.tie_word_embeddings,
              "attention_bias": cfg.attention_bias, "bos_token_id": cfg.bos_token_id,
              "eos_token_id": list(cfg.eos_token_ids)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok = ck.tokenizer
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write(tok.backend.to_str())
    eos = tok.backend.id_to_token(tok.eos_token_ids[0]) if tok.eos_token_ids else None
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template, "eos_token": eos,
                   "add_bos_token": tok.add_bos_token}, f)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.spec_decode.make_draft",
                                description=__doc__)
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M)")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    print(write_draft(load_checkpoint(args.model), args.layers, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
