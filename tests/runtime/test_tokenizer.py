"""Tokenizer: round trips, special tokens, chat template, and agreement with transformers."""
from __future__ import annotations

import os

import pytest

from contract.errors import InvalidRequestError
from contract.tokenizer import Tokenizer
from runtime.loading.gguf import read_gguf_tokenizer
from runtime.loading.loader import default_model_path
from tests.runtime.test_gguf_loader import CONTROL, write_tiny_gguf

TEXTS = [
    "Hello, world!", "The year 2024 had 366 days.", " 12 345 6789", "3.14159", "x1 = y22 + z333",
    "Héllo wörld — naïve café", "日本語のテキスト", "emoji 🙂👍🏽🇫🇷 done",
    "def f(x):\n    return x ** 2\n", "<|im_start|>user\nHi<|im_end|>\n",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n", "", "a" * 50, "It's we're they'll I'd", "Ünïcödé ÀÉÎ",
    "https://example.com/path?q=1&r=2", '{"json": [1, 2, 3]}', "<|endoftext|>text<|endoftext|>",
    "Привет, мир", "١٢٣ ٤٥٦", "①②③ ½ ²",
]
# Known differences from transformers' GGUF tokenizer: we split every Unicode number character
# alone (as the original SmolLM2 tokenizer.json and llama.cpp's 'smollm' pre-tokenizer do);
# transformers' converter drops that split, which shows only on non-ASCII numerals, since the
# vocabulary has no multi-digit ASCII tokens.
KNOWN_DIFFERENT = {"١٢٣ ٤٥٦", "①②③ ½ ²"}


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("tok") / "tiny.gguf")
    write_tiny_gguf(path)
    return read_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return read_gguf_tokenizer(default_model_path())


# a tiny byte-level vocabulary: the same code path, no model file needed


def test_tiny_round_trip_and_specials(tiny_tok):
    for text in TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(text), skip_special_tokens=False) == text
    ids = tiny_tok.encode("<|im_start|>the")
    assert ids[0] == CONTROL.index("<|im_start|>") and tiny_tok.is_special(ids[0])
    assert tiny_tok.decode(ids) == "the"  # specials skipped by default
    assert tiny_tok.encode(" the")[0] == tiny_tok.token_to_id("Ġthe")  # merges applied


def test_tiny_serialization_round_trip(tiny_tok):
    again = Tokenizer.from_json(tiny_tok.to_json())
    assert again.encode(TEXTS[7]) == tiny_tok.encode(TEXTS[7])
    assert (again.eos_token_ids, again.bos_token_id, again.chat_template) == \
        (tiny_tok.eos_token_ids, tiny_tok.bos_token_id, tiny_tok.chat_template)


def test_token_bytes_of_split_emoji(tiny_tok):
    ids = tiny_tok.encode("🙂")
    assert len(ids) == 4  # no merges for it: one token per UTF-8 byte
    assert b"".join(tiny_tok.token_bytes(i) for i in ids) == "🙂".encode()


def test_message_validation(tiny_tok):
    for bad in [None, [], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]]:
        with pytest.raises(InvalidRequestError):
            tiny_tok.apply_chat_template(bad)


def test_no_chat_template_is_a_clear_error(tiny_tok):
    bare = Tokenizer(tiny_tok.backend, bos_token_id=1, eos_token_ids=(2,))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_and_bos_eos_variables(tiny_tok):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                "{% endif %}{{ bos_token }}{% for m in messages %}\n  {{ m['content'] }}"
                "{{ eos_token }}{% endfor %}")
    tok = Tokenizer(tiny_tok.backend, bos_token_id=1, eos_token_ids=(2,), chat_template=template)
    # trim_blocks (as in HF) drops the newline right after the `for` tag
    rendered = tok.apply_chat_template([{"role": "user", "content": "a"}])
    assert rendered == "<|im_start|>  a<|im_end|>"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "a"}])


# the real SmolLM2 tokenizer


@pytest.mark.model
def test_smol_round_trips(smol):
    for text in TEXTS:
        assert smol.decode(smol.encode(text), skip_special_tokens=False) == text, text
    assert smol.vocab_size == 49152 and smol.bos_token_id == 1 and smol.eos_token_ids == (2,)
    assert not smol.add_bos_token  # SmolLM2 adds no BOS, even when special tokens are asked for
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")


@pytest.mark.model
def test_smol_special_tokens_are_single_ids(smol):
    for i, text in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert smol.encode(text) == [i] and smol.is_special(i)
    assert not smol.is_special(smol.encode("hello")[0])


@pytest.mark.model
def test_smol_chat_template(smol):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert smol.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *messages,
                   {"role": "assistant", "content": "4"}]
    assert smol.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n")


@pytest.mark.model
def test_smol_matches_transformers(smol):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                        gguf_file=os.path.basename(path))
    different = {t for t in TEXTS if smol.encode(t) != theirs.encode(t, add_special_tokens=False)}
    assert different == KNOWN_DIFFERENT
    messages = [{"role": "user", "content": "Hi"}]
    assert smol.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    ids = smol.encode(TEXTS[7] + TEXTS[8])
    assert smol.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.model
def test_encode_without_gil_is_encode(smol):
    """The gateway tokenizes long texts through the batch entry point in a thread; it must
    give exactly the ids of `encode`, special tokens included."""
    long_text = " ".join(TEXTS) * 200
    for text in TEXTS + [long_text]:
        assert smol.encode_without_gil(text) == smol.encode(text), text[:40]
