"""`--spec off|ngram|self:L|draft:PATH|mtp[:K]`, parsed once at engine start."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # off | ngram | self | draft | mtp
    num_layers: int = 0  # self: the target's first L layers draft
    draft_path: str | None = None  # draft: a GGUF file or HF folder with the same vocabulary
    num_tokens: int = 4  # the most tokens proposed per request per step
    max_batch: int = 4  # above this many decoding requests the step is compute-bound: no spec

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def parse(cls, text: str | None, num_tokens: int = 4, max_batch: int = 4) -> SpecConfig:
        text = (text or "off").strip()
        if text == "off":
            return cls()
        if text == "ngram":
            return cls("ngram", num_tokens=num_tokens, max_batch=max_batch)
        kind, _, arg = text.partition(":")
        if kind == "self" and arg.isdigit() and int(arg) > 0:
            return cls("self", num_layers=int(arg), num_tokens=num_tokens, max_batch=max_batch)
        if kind == "draft" and arg:
            return cls("draft", draft_path=arg, num_tokens=num_tokens, max_batch=max_batch)
        if text == "mtp" or kind == "mtp" and arg.isdigit() and int(arg) > 0:
            # the checkpoint's multi-token-prediction module (DeepSeek-V3/R1), applied on its
            # own output for K > 1 drafts (K: the most proposed per step, else num_tokens)
            return cls("mtp", num_tokens=int(arg) if arg else num_tokens, max_batch=max_batch)
        raise ValueError(f"--spec must be off, ngram, self:L (L > 0), draft:PATH or mtp[:K] "
                         f"(K > 0), got {text!r}")
