"""Token bitmasks: made by llguidance for many matchers at once, applied to logits in one op.

A bitmask row has one bit per vocabulary token (int32 words, token t at bit t % 32 of word
t // 32). A matcher with proposed tokens gets one row per position: its next token's mask,
then the mask after each proposal (llguidance advances the matcher over the proposals and
rolls it back). Rows after a proposal the grammar refuses, or after an end-of-sequence
proposal, stay all-allowed and never matter: the refused proposal is rejected for sure, and
an accepted end token finishes the request, dropping whatever followed it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import llguidance
import torch
import torch.nn.functional as F

# byte value -> its 8 bits, 1 where the token is refused: a lookup per mask byte unpacks a
# row faster than shifting every 32-bit word 32 times (5 against 8.5 ms for 32 rows here)
_REFUSED = (((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0).to(torch.uint8)


@dataclass
class MaskStats:
    num_rows: int = 0  # masks computed (one per constrained position)
    seconds: float = 0.0  # spent computing them


class MaskMaker:
    def __init__(self, vocab_size: int, threads: int | None = None):
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.threads = threads or min(4, os.cpu_count() or 1)
        self._executor: llguidance.LLExecutor | None = None  # its threads start at first use
        self.stats = MaskStats()

    def fill(self, entries: list[tuple[llguidance.LLMatcher, list[int]]]
             ) -> tuple[torch.Tensor, list[int]]:
        """Bitmask rows [sum(1 + len(drafts)), words] for (matcher, drafts) entries, and the
        first row of each entry. Matchers are left as they were."""
        start = time.perf_counter()
        first, row = [], 0
        for _, drafts in entries:
            first.append(row)
            row += 1 + len(drafts)
        bits = torch.full((row, self.num_words), -1, dtype=torch.int32)  # contiguous, CPU
        # the executor writes row r at data_ptr + r * row_bytes (llguidance.torch's wrappers
        # do the same, but importing that module starts torch.compile's machinery: seconds)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        where = (bits.data_ptr(), self.num_words * 4, row)
        plain = [(m, r) for (m, d), r in zip(entries, first) if not d]
        drafted = [(m, r, list(d)) for (m, d), r in zip(entries, first) if d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *where)
        if drafted:  # the library's draft call takes no entry without drafts
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *where)
        self.stats.num_rows += row
        self.stats.seconds += time.perf_counter() - start
        return bits, first


def refused_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] booleans, True where bitmask rows refuse the token (and past the
    mask's end). Bytes are read in memory order: little-endian words, as on every device
    torch runs on, put token 32 w + 8 k + j at bit j of byte k of word w."""
    as_bytes = bits.contiguous().view(torch.uint8).long()
    refused = F.embedding(as_bytes, _REFUSED.to(bits.device)).view(bits.shape[0], -1).bool()
    refused = refused[:, :vocab_size]
    if refused.shape[1] < vocab_size:
        pad = torch.ones(bits.shape[0], vocab_size - refused.shape[1], dtype=torch.bool,
                         device=bits.device)
        refused = torch.cat((refused, pad), dim=1)
    return refused


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return ~refused_tokens(bits, vocab_size)


@dataclass(frozen=True)
class TokenMask:
    """The masks of some rows of a step's logits: row `rows[i]` gets bitmask `bits[i]`."""

    rows: list[int]
    bits: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with every refused token at -inf in the masked rows (out of place: the
        other rows are the same values, so a free request's result does not change)."""
        refused = refused_tokens(self.bits.to(logits.device), logits.shape[1])
        if self.rows == list(range(logits.shape[0])):  # every row masked: no gather
            return logits.masked_fill(refused, float("-inf"))
        idx = torch.tensor(self.rows, device=logits.device)
        masked = logits.index_select(0, idx).masked_fill(refused, float("-inf"))
        return logits.index_copy(0, idx, masked)
