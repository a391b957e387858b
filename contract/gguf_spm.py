"""SentencePiece ("llama") vocabularies of GGUF files as a `tokenizers` backend.

A GGUF file with `tokenizer.ggml.model = "llama"` stores a SentencePiece BPE vocabulary: pieces
with scores and token types, no merges. llama.cpp (llama-vocab.cpp `llm_tokenizer_spm`)
tokenizes it so:

1. control, unknown-type and user-defined pieces are cut out of the text whole first (our
   `Tokenizer.encode` parses specials, like llama.cpp with `parse_special`);
2. each remaining fragment has " " replaced by "▁" (and, with `add_space_prefix`, a "▁"
   prepended: llama.cpp does so at the start of the text and after every cut-out token);
3. the fragment is split into characters, and the adjacent pair whose concatenation is a piece
   with the highest score is merged, again and again (ties: the leftmost pair);
4. a character that is no piece becomes its UTF-8 bytes' `<0xNN>` pieces.

A BPE model does step 3 when it has, for every piece, a merge for every way of cutting the piece
into two pieces, ranked by the piece's score (best first): its merge loop also takes the pair
of best rank, leftmost on a tie. Step 4 is its `byte_fallback`. The merges are derived here
from the vocabulary (`spm_merges`), once per load: about 0.5 M merges for Gemma 3's 262k
pieces, in under a second of one core.

Where this BPE can part from llama.cpp (a merge rank is one per merge, a score one per piece);
none shows in Gemma 3's vocabulary, whose merged pieces all have distinct scores, on the text
and the random and adversarial strings tested against a port of llama.cpp:
- two pairs yielding the same piece by different cuts, overlapping (`[ab][a][ba]` ->
  "aba"): llama.cpp takes the leftmost, BPE the better-ranked cut (the longer left part
  first, as transformers orders them);
- two different pieces with the same score (or a file without scores): llama.cpp takes the
  leftmost pair, BPE the piece of lower id;
- a piece containing a character that is no piece of its own: llama.cpp can merge that
  character into it, BPE has already replaced it by byte pieces.

Decoding: "▁" back to " ", `<0xNN>` pieces to their bytes, fused (and, with
`add_space_prefix`, the first space stripped).
"""
from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Backend

from contract.errors import ModelLoadError

# llama.cpp token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space
_SPECIAL = (CONTROL, UNKNOWN)  # cut out of the text whole, skipped when decoding
_NOT_MERGED = (CONTROL, UNKNOWN, USER_DEFINED)  # matched whole before the model, never built
_HEX = frozenset("0123456789abcdefABCDEF")


def spm_backend(meta: dict) -> Backend:
    """A tokenizer for a SentencePiece GGUF vocabulary (`tokenizer.ggml.*` keys without that
    prefix), tokenizing and decoding as llama.cpp does; no BOS post-processor (the caller's)."""
    tokens = list(meta["tokens"])
    n = len(tokens)
    scores = meta.get("scores") or [0.0] * n
    types = meta.get("token_type") or [NORMAL] * n
    if len(scores) != n or len(types) != n:
        raise ModelLoadError(f"SentencePiece vocabulary has {n} tokens but {len(scores)} scores "
                             f"and {len(types)} token types")
    unk_id = meta.get("unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types),
                                 unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("add_space_prefix", True))  # llama.cpp's default for SPM
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) \
        if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + [decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    # whole-match: "<start_of_turn>" must not be spelled out in pieces; user-defined pieces
    # (Gemma's "\n", runs of spaces, HTML tags) keep their literal text and match raw text
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in _SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    return backend


def spm_merges(tokens: list[str], scores: list[float],
               types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-greedy merging: for each piece, best score
    first (a tie: lower id first), every cut of it into two pieces, the longer left part first.

    Control, unknown-type and user-defined pieces are neither built nor building blocks: they
    are matched whole in the text before the model runs, so no merge could reach them."""
    ids = [i for i, k in enumerate(types) if k not in _NOT_MERGED]
    ids.sort(key=scores.__getitem__, reverse=True)  # stable: equal scores keep id order
    targets = [tokens[i] for i in ids]
    pieces = set(targets)
    # one comprehension: the per-cut work is two slices and two set lookups, nothing else
    return [(left, right) for t in targets for j in range(len(t) - 1, 0, -1)
            if (left := t[:j]) in pieces and (right := t[j:]) in pieces]


def piece_bytes(piece: str) -> bytes:
    """The bytes a (non-special) SentencePiece piece stands for: `<0x0A>` is one byte,
    any other piece its text with "▁" read as a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") \
            and all(c in _HEX for c in piece[3:5]):
        return bytes([int(piece[3:5], 16)])
    return piece.replace(SPACE, " ").encode("utf-8")


def decodes_byte_fallback(backend: Backend) -> bool:
    """Whether `backend` decodes `<0xNN>` pieces to bytes (a SentencePiece-style decoder)."""
    decoder = backend.decoder
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
