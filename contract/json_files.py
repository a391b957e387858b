"""Reading the JSON files of a model folder, with errors that name the file."""
from __future__ import annotations

import json
import os

from contract.errors import ModelLoadError


def read_json(path: str, required: bool) -> dict:
    """The JSON object in `path`; {} when it is absent and not required."""
    if not os.path.exists(path):
        if required:
            raise ModelLoadError(f"{path}: missing")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable JSON: {e}") from e
