"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
decoders whose output depends on the previous token. So each step decodes a short window of
already-emitted tokens plus the new ones and emits the difference. Text that could be the start
of a stop string is held back until the next tokens decide it.
"""
from __future__ import annotations

from contract.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
MAX_HELD_TOKENS = 8  # beyond this a trailing U+FFFD is the model's real output, not a split char


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; stops at the first stop string.

    Invariants: the concatenation of everything `push` and `flush` return equals `text`;
    `text` never contains a stop string; without stops, after `flush`, `text` equals
    `tokenizer.decode(all pushed ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids_tail: list[int] | None = None,
                 stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.stop_reason: str | None = None
        self._ids = list(prompt_token_ids_tail or [])
        self._prefix_offset = 0  # window start: context that shapes how new tokens decode
        self._read_offset = len(self._ids)  # tokens before this are already in text or held
        self._held = ""  # decoded text that might begin a stop string
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text that is now certain (may be '')."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return everything held back (nothing if a stop string matched)."""
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    # decoding

    def _decode_new(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        end = len(self._ids)
        full = self._decode(self._prefix_offset, end)
        if full.endswith(REPLACEMENT) and not final:
            # a character split over tokens spans at most 3 trailing ones: emit what precedes it
            for cut in range(end - 1, max(self._read_offset, end - 4), -1):
                if not (text := self._decode(self._prefix_offset, cut)).endswith(REPLACEMENT):
                    end, full = cut, text
                    break
            else:
                if end - self._read_offset < MAX_HELD_TOKENS:
                    return ""  # wait: the next token may complete the character
        self._prefix_offset, self._read_offset = self._read_offset, end
        return full[len(prefix):] if full.startswith(prefix) else full

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens)

    # stop strings

    def _release(self, new_text: str, final: bool) -> str:
        pending = self._held + new_text
        cut, reason = self._find_stop(pending)
        if reason is not None:
            self.stopped, self.stop_reason = True, reason
            return self._emit(pending[:cut], held="")
        keep = 0 if final else self._partial_stop_len(pending)
        return self._emit(pending[:len(pending) - keep], held=pending[len(pending) - keep:])

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        """Earliest stop string in `text` (first listed wins a tie)."""
        best, reason = len(text) + 1, None
        for s in self.stop:
            i = text.find(s)
            if i != -1 and i < best:
                best, reason = i, s
        return best, reason

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop), default=0)
        for n in range(min(len(text), longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit(self, out: str, held: str) -> str:
        self._held = held
        if out:
            self._chunks.append(out)
        return out
