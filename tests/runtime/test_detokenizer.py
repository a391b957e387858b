"""Incremental detokenization: split characters, stop strings across tokens, hold-back, flush."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.tokenizer import Tokenizer
from runtime.detokenizer import IncrementalDetokenizer
from runtime.loading.gguf import read_gguf_tokenizer
from runtime.loading.loader import default_model_path
from tests.runtime.test_gguf_loader import write_tiny_gguf

TEXT = "Hi 🙂! Café 日本 👍🏽 def f(x):\n  return 42 <end> tail"


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm", marks=pytest.mark.model)])
def tok(request, tmp_path_factory) -> Tokenizer:
    if request.param == "smollm":
        return read_gguf_tokenizer(default_model_path())
    path = str(tmp_path_factory.mktemp("detok") / "tiny.gguf")
    write_tiny_gguf(path)
    return read_gguf_tokenizer(path)  # byte-level, few merges: most characters span tokens


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Push one id at a time, as the engine does; the last delta is the flush."""
    return [detok.push([i]) for i in ids] + [detok.flush()]


def test_never_emits_half_a_character_and_equals_full_decode(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # emoji and CJK really are split over several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == TEXT


def test_emoji_held_until_complete(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1 or tok.vocab_size > 1000  # tiny vocab: one id per byte
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_pushing_many_ids_at_once(tok):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    out = detok.push(ids[:7]) + detok.push(ids[7:20]) + detok.push(ids[20:]) + detok.flush()
    assert out == TEXT


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, stop=("<end>",))
    deltas = []
    for i in ids:
        deltas.append(detok.push([i]))
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_reason == "<end>"
    assert "".join(deltas) == detok.text == TEXT[:TEXT.index("<end>")]
    assert detok.push(ids[-1:]) == "" and detok.flush() == ""  # nothing after the stop


def test_earliest_stop_wins(tok):
    detok = IncrementalDetokenizer(tok, stop=("tail", "42"))
    stream(detok, tok.encode(TEXT))
    assert detok.stop_reason == "42" and detok.text == TEXT[:TEXT.index("42")]


def test_possible_stop_prefix_held_then_flushed(tok):
    text = "value <en"  # ends with a prefix of "<end>": held until the stream ends
    detok = IncrementalDetokenizer(tok, stop=("<end>",))
    pushed = "".join(detok.push([i]) for i in tok.encode(text))
    assert pushed == "value " and not detok.stopped
    assert detok.flush() == "<en" and detok.text == text


def test_held_prefix_released_when_it_diverges(tok):
    detok = IncrementalDetokenizer(tok, stop=("<end>",))
    first = "".join(detok.push([i]) for i in tok.encode("a <e"))
    assert first == "a " and detok.text == "a "  # "<e" might start "<end>"
    rest = "".join(detok.push([i]) for i in tok.encode("x b"))
    assert first + rest == detok.text == "a <ex b" and not detok.stopped


def test_prompt_tail_context_not_emitted(tok):
    prompt, completion = tok.encode("Hello there"), tok.encode(" 🙂 friend")
    detok = IncrementalDetokenizer(tok, prompt_token_ids_tail=prompt[-3:])
    assert "".join(stream(detok, completion)) == " 🙂 friend"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("a<|im_end|>b")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "ab"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "a<|im_end|>b"


def test_invalid_bytes_eventually_emitted(tok):
    """A model may emit bytes that never form a character: they must not be held forever."""
    lone = tok.encode("🙂")[:1] if tok.vocab_size < 1000 else None
    if lone is None:
        pytest.skip("needs a vocabulary with single-byte tokens")
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(lone) for _ in range(12))
    assert "\ufffd" in out


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("detok-prop") / "tiny.gguf")
    write_tiny_gguf(path)
    return read_gguf_tokenizer(path)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), stops=st.lists(st.text(min_size=1, max_size=4), max_size=2),
       chunk=st.integers(1, 5))
def test_any_chunking_matches_full_decode_cut_at_first_stop(tiny_tok, text, stops, chunk):
    ids = tiny_tok.encode(text)
    full = tiny_tok.decode(ids)
    hits = [(full.find(s), s) for s in stops if s in full]
    want = full[:min(hits)[0]] if hits else full
    detok = IncrementalDetokenizer(tiny_tok, stop=tuple(stops))
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(deltas) == detok.text == want
    assert detok.stopped == bool(hits)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full
