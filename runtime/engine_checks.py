"""What an engine refuses before it loads anything: a device this process cannot use, a context
longer than the model's. Each is a StartError, the one line a worker reports and exits on."""
from __future__ import annotations

import torch

from contract.errors import StartError


def check_device(device: str) -> None:
    """A CUDA device this process cannot see is a StartError, not torch's AssertionError from
    deep in the model's construction."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "is a CPU-only build" if torch.version.cuda is None and torch.version.hip is None \
            else "sees no GPU"
        raise StartError(f"--device {device}: torch {torch.__version__} {build}; use --device "
                         f"cpu, or a machine and a torch build with CUDA")


def context_length(requested: int | None, model: str, model_context: int) -> int:
    """--max-model-len, or the model's context; more than the model's context is refused, as
    vLLM does: positions past what the model was trained on give garbage, not longer answers."""
    if requested is None:
        return model_context
    if requested > model_context:
        raise StartError(f"--max-model-len {requested} exceeds the context of {model} "
                         f"({model_context} tokens); give at most {model_context}")
    return requested
