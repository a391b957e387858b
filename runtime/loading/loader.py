"""Load a checkpoint (GGUF file or Hugging Face folder) into config, weights, tokenizer.

A GGUF file's header is parsed here; its tensors are read when the model takes them
(runtime/loading/gguf.py `GGUFWeights`), quantized matrices straight into the blocks the
kernels serve. No cache: reading the blocks from the mapped file costs what reading a float32
copy back from disk did, and that copy was 5.5x the file's size (docs/perf.md, issue 34).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Mapping
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
from runtime.loading.calibration import resolve_cache_dir

_GGUF_MAGIC = GGUF_MAGIC
log = logging.getLogger("runtime.startup")
# what the float32 weight cache of earlier versions wrote: <file stem>-<24 hex>.safetensors
_OLD_CACHE_FILE = re.compile(r".+-[0-9a-f]{24}\.safetensors")


@dataclass
class Checkpoint:
    config: ModelConfig
    # HF names; `[name]` is float32 (no lm_head when embeddings are tied). A GGUF file's
    # mapping reads each tensor when asked and also offers `blocks(name)` (GGUFWeights).
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    load_seconds: float


def load_checkpoint(path: str | None = None, keep_mtp: bool = False) -> Checkpoint:
    """Load `path` (default: SmolLM2). `keep_mtp`: a Hugging Face folder's multi-token-
    prediction layers are kept (`--spec mtp`), else skipped."""
    path = path or default_model_path()
    start = time.perf_counter()
    if os.path.isdir(path):
        from runtime.loading.hf import read_hf_folder

        log.info("loading %s (Hugging Face folder)", path)
        config, weights, tokenizer = read_hf_folder(path, keep_mtp)
        what = f"{len(weights)} tensors read"
    elif os.path.isfile(path):
        _check_gguf_magic(path)
        log.info("loading %s (%s, GGUF)", os.path.basename(path), _size(os.path.getsize(path)))
        config, weights, tokenizer = _open_gguf(path)
        what = f"tensors {_counts(weights.type_counts())}, read as the model takes them"
    else:
        raise ModelLoadError(f"{path}: no such file or folder")
    config = dataclasses.replace(config, name=model_name(path), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids)
    seconds = time.perf_counter() - start
    log.info("header and tokenizer read in %.2f s: %s, %d layers, hidden %d, vocabulary %s; %s",
             seconds, config.architecture, config.num_hidden_layers, config.hidden_size,
             f"{config.vocab_size:,}", what)
    return Checkpoint(config, weights, tokenizer, os.path.abspath(path), seconds)


def _open_gguf(path: str):
    from runtime.loading.gguf import open_gguf

    _remove_old_weight_cache(path)
    return open_gguf(path)


def _remove_old_weight_cache(path: str) -> None:
    """Delete the float32 copies earlier versions cached for this file (5.5x its size each);
    nothing reads them any more."""
    folder = resolve_cache_dir()
    stem = os.path.splitext(os.path.basename(path))[0]
    try:
        names = [n for n in os.listdir(folder)
                 if n.startswith(stem + "-") and _OLD_CACHE_FILE.fullmatch(n)]
    except OSError:
        return  # no cache folder: nothing to remove
    for name in names:
        try:
            size = os.path.getsize(os.path.join(folder, name))
            os.remove(os.path.join(folder, name))
            log.info("removed %s (%s), the float32 weight cache of an earlier version",
                     name, _size(size))
        except OSError:
            pass  # another process removed it, or a read-only folder: harmless


def _check_gguf_magic(path: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: unreadable: {e}") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}) nor a model folder")


def _size(nbytes: int) -> str:
    if nbytes >= 2 ** 30:
        return f"{nbytes / 2 ** 30:.1f} GiB"
    return f"{nbytes / 2 ** 20:.0f} MiB" if nbytes >= 2 ** 20 else f"{nbytes / 2 ** 10:.0f} KiB"


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items())
