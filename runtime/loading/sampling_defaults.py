"""The sampling defaults a model file asks for: a Hugging Face folder's `generation_config.json`,
or a GGUF file's `general.sampling.*` metadata (else the documented profile for GGUF files)."""
from __future__ import annotations

import os

from contract.errors import ModelLoadError
from contract.json_files import read_json
from contract.sampling_defaults import FIELDS, GGUF_KEYS, GGUF_PROFILE, PROFILES, check
from runtime.loading.gguf import read_header


def model_sampling_defaults(path: str) -> dict[str, float | int]:
    """The defaults the model at `path` (a HF folder or a GGUF file) asks for."""
    if os.path.isdir(path):
        found = _from_generation_config(os.path.join(path, "generation_config.json"))
    else:
        found = _from_gguf(path)
        if not found:
            return dict(PROFILES[GGUF_PROFILE])
    try:
        check(found)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: its sampling defaults are invalid: {exc}") from None
    return found


def _from_generation_config(path: str) -> dict[str, float | int]:
    config = read_json(path, required=False)
    return {name: kind(config[name]) for name, kind in FIELDS.items()
            if isinstance(config.get(name), (int, float)) and not isinstance(config[name], bool)}


def _from_gguf(path: str) -> dict[str, float | int]:
    meta, _ = read_header(path)  # metadata only, a fraction of a second
    return {name: FIELDS[name](meta[key]) for key, name in GGUF_KEYS.items() if key in meta}
