"""Export the runtime's tokenizer as a Hugging Face tokenizer folder.

Third-party load testers (AIPerf, GuideLLM) count tokens and build prompts with
`transformers.AutoTokenizer.from_pretrained(DIR)`. Our model ships as a GGUF file, so without
this they would fetch a tokenizer from the Hub. The folder written here holds exactly our
tokenizer: the same `tokenizers` pipeline (tokenizer.json), the same chat template and the same
special tokens, so their token counts equal the gateway's usage.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from contract.errors import ModelLoadError
from contract.json_files import read_json
from contract.tokenizer import Tokenizer

# PreTrainedTokenizerFast takes tokenizer.json as it is. A model-specific class (the original
# SmolLM2 folder names GPT2Tokenizer) may rebuild parts of the pipeline from vocab and merges,
# which would lose the GGUF pre-tokenizer (SmolLM2 splits every digit alone).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class TokenizerSource:
    """Our tokenizer plus what HF wants beside it that the runtime does not keep."""
    tokenizer: Tokenizer
    pad_token_id: int | None
    unk_token_id: int | None
    model_max_length: int | None


def export_tokenizer(out_dir: str, model_path: str | None = None) -> list[str]:
    """Write the tokenizer of `model_path` (default: SmolLM2) into `out_dir`; return the files."""
    from runtime.loading.loader import default_model_path

    path = model_path or default_model_path()
    if os.path.isdir(path):
        source = read_folder_source(path)
    elif os.path.isfile(path):
        source = read_gguf_source(path)
    else:
        raise ModelLoadError(f"{path}: no such file or folder")
    return write_folder(source, out_dir)


def read_gguf_source(path: str) -> TokenizerSource:
    """From a GGUF file's header (the weights are not read)."""
    from runtime.loading.gguf import read_gguf_tokenizer, read_header

    meta, _ = read_header(path)
    arch = meta.get("general.architecture")
    return TokenizerSource(read_gguf_tokenizer(path),
                           pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
                           unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
                           model_max_length=meta.get(f"{arch}.context_length"))


def read_folder_source(folder: str) -> TokenizerSource:
    """From a Hugging Face folder, read the way the runtime reads it (hf_loader.py)."""
    tokenizer = Tokenizer.from_hf_folder(folder)
    cfg = read_json(os.path.join(folder, "tokenizer_config.json"), required=False)
    model = read_json(os.path.join(folder, "config.json"), required=False)

    def token_id(key: str) -> int | None:
        text = cfg.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        return tokenizer.token_to_id(text) if text else None

    return TokenizerSource(tokenizer, pad_token_id=token_id("pad_token"),
                           unk_token_id=token_id("unk_token"),
                           model_max_length=model.get("max_position_embeddings"))


def write_folder(source: TokenizerSource, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    tok = source.tokenizer
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    specials = special_tokens(source)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), specials)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(source, specials))
    return [os.path.join(out_dir, name) for name in FILES]


def special_tokens(source: TokenizerSource) -> dict[str, str | list[str]]:
    """bos/eos/pad/unk as text, and the other special tokens (HF skips them in decode too)."""
    tok = source.tokenizer
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    # no pad token of its own: pad with EOS, as HF's generate does
    pad = source.pad_token_id if source.pad_token_id is not None else eos
    named = {"bos_token": tok.bos_token_id, "eos_token": eos, "pad_token": pad,
             "unk_token": source.unk_token_id}
    out: dict[str, str | list[str]] = {
        k: tok.backend.id_to_token(i) for k, i in named.items() if i is not None}
    added = tok.backend.get_added_tokens_decoder()
    others = [t.content for _, t in sorted(added.items())
              if t.special and t.content not in out.values()]
    if others:
        out["additional_special_tokens"] = others
    return out


def tokenizer_config(source: TokenizerSource, specials: dict) -> dict:
    tok = source.tokenizer
    cfg = {
        "tokenizer_class": TOKENIZER_CLASS,
        **specials,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": False,
        # our decode joins the byte-level pieces as they are; HF's clean-up would drop spaces
        # before punctuation and so change the text
        "clean_up_tokenization_spaces": False,
        "model_max_length": source.model_max_length or 1 << 30,
    }
    if tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    return cfg


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
        f.write("\n")
