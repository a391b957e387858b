"""Cache of dequantized GGUF checkpoints as safetensors files.

Dequantizing and parsing GGUF metadata costs seconds on every start; a float32 safetensors copy
loads in a fraction of that. One cache file holds the weights and, in its header metadata, the
config and the tokenizer, so a hit never opens the GGUF file. The key is a hash of the source's
absolute path, size and mtime: editing or replacing the file misses the cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

import torch

from contract.config import ModelConfig
from contract.tokenizer import Tokenizer

FORMAT_VERSION = "2"  # bump when the stored layout or name mapping changes
DEFAULT_DIR = os.path.join("~", ".cache", "inferstack", "weights")


def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """The explicit folder, else $INFERSTACK_CACHE_DIR, else ~/.cache/inferstack/weights."""
    return os.path.expanduser(cache_dir or os.environ.get("INFERSTACK_CACHE_DIR") or DEFAULT_DIR)


def cache_key(source: str) -> str:
    st = os.stat(source)
    ident = f"{FORMAT_VERSION}\0{os.path.abspath(source)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def cache_path(source: str, cache_dir: str | None = None) -> str:
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(resolve_cache_dir(cache_dir), f"{stem}-{cache_key(source)}.safetensors")


def load(source: str, cache_dir: str | None = None
         ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
    """The cached checkpoint of `source`, or None on a miss. A corrupt file is deleted."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = cache_path(source, cache_dir)
    if not os.path.exists(path):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        config = ModelConfig(**_tuples(json.loads(meta["inferstack.config"])))
        tokenizer = Tokenizer.from_json(meta["inferstack.tokenizer"])
        weights = load_file(path)
        if "model.norm.weight" not in weights:
            raise ValueError("incomplete weights")
    except Exception:  # noqa: BLE001 - truncated, garbled or from another version: rebuild it
        _remove(path)
        return None
    return config, weights, tokenizer


def store(source: str, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer,
          cache_dir: str | None = None) -> str:
    """Write the cache file for `source` atomically (temp file in the same folder + rename)."""
    from safetensors.torch import save_file

    path = cache_path(source, cache_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = {"format": "pt", "inferstack.version": FORMAT_VERSION,
            "inferstack.source": os.path.abspath(source),
            "inferstack.config": json.dumps(dataclasses.asdict(config)),
            "inferstack.tokenizer": tokenizer.to_json()}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp, metadata=meta)
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a part
    except BaseException:
        _remove(tmp)
        raise
    return path


def _tuples(d: dict) -> dict:
    """JSON turns tuples into lists; ModelConfig is hashable only with tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
