"""Load a checkpoint (GGUF file or Hugging Face folder) into config, float32 weights, tokenizer."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.model_files import (  # noqa: F401
    DEFAULT_GGUF,
    GGUF_MAGIC,
    default_model_path,
    model_name,
)
from contract.tokenizer import Tokenizer
from runtime.loading import weight_cache

_GGUF_MAGIC = GGUF_MAGIC


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, float32; no lm_head when embeddings are tied
    tokenizer: Tokenizer
    source: str
    load_seconds: float
    from_cache: bool


def load_checkpoint(path: str | None = None, cache_dir: str | None = None,
                    use_cache: bool = True) -> Checkpoint:
    """Load `path` (default: SmolLM2); GGUF weights go through the dequantized-weight cache."""
    path = path or default_model_path()
    start = time.perf_counter()
    if os.path.isdir(path):
        from runtime.loading.hf import read_hf_folder

        (config, weights, tokenizer), from_cache = read_hf_folder(path), False
    elif os.path.isfile(path):
        _check_gguf_magic(path)
        config, weights, tokenizer, from_cache = _load_gguf(path, cache_dir, use_cache)
    else:
        raise ModelLoadError(f"{path}: no such file or folder")
    config = dataclasses.replace(config, name=model_name(path), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids)
    return Checkpoint(config, weights, tokenizer, os.path.abspath(path),
                      time.perf_counter() - start, from_cache)


def _load_gguf(path: str, cache_dir: str | None, use_cache: bool):
    from runtime.loading.gguf import read_gguf

    if use_cache and (hit := weight_cache.load(path, cache_dir)) is not None:
        return (*hit, True)
    config, weights, tokenizer = read_gguf(path)
    if use_cache:
        try:
            weight_cache.store(path, config, weights, tokenizer, cache_dir)
        except OSError as e:  # a read-only or full disk slows the next start; not an error now
            logging.getLogger(__name__).warning("weight cache not written: %s", e)
    return config, weights, tokenizer, False


def _check_gguf_magic(path: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: unreadable: {e}") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}) nor a model folder")
