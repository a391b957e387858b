"""Prompt-lookup proposals: find the latest earlier occurrence of the request's last few
tokens (prompt and output alike) and propose what followed it. No model, no tensors."""
from __future__ import annotations


def propose_ngram(tokens: list[int], num_tokens: int, max_ngram: int = 4,
                  min_ngram: int = 1, window: int = 4096) -> list[int]:
    """Up to `num_tokens` proposed continuations of `tokens` (may be empty)."""
    if num_tokens <= 0 or len(tokens) < 2:
        return []
    start = max(0, len(tokens) - window)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # scan backwards for the most recent earlier match of the suffix
        for i in range(len(tokens) - n - 1, start - 1, -1):
            if tokens[i:i + n] == suffix:
                follow = tokens[i + n:i + n + num_tokens]
                if follow:
                    return follow
    return []
