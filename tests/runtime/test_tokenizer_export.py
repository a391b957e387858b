"""The exported Hugging Face tokenizer folder: transformers loads it offline and it tokenizes,
detokenizes and renders chat exactly as our tokenizer does (SmolLM2's GGUF, a tiny GGUF and a
tiny Hugging Face folder)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from contract.tokenizer import Tokenizer
from runtime.loading.gguf import read_gguf_tokenizer
from runtime.loading.loader import default_model_path
from runtime.loading.tokenizer_export import FILES, TOKENIZER_CLASS, export_tokenizer
from tests.runtime.test_gguf_loader import write_tiny_gguf
from tests.runtime.test_tokenizer import TEXTS

transformers = pytest.importorskip("transformers")

# TEXTS holds unicode, digits, whitespace runs and special tokens inside text; these add
# the specials alone, back to back and glued to words, and spaces before punctuation (which
# HF's clean_up_tokenization_spaces would drop on decode)
EXTRA_TEXTS = ["<|im_start|>", "<|im_end|><|im_start|>", "x<|im_end|>y", "<|endoftext|>",
               "a , b . c don 't !"]
CONVERSATION = [
    {"role": "system", "content": "Answer in one word. Ünïcödé 🙂 welcome."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of 日本?"},
]


def load_offline(folder, monkeypatch, tmp_path):
    """transformers with no network and an empty cache: only the folder can supply files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return read_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol-tokenizer")
    export_tokenizer(str(folder))
    return folder


@pytest.fixture
def theirs(smol_folder, monkeypatch, tmp_path):
    return load_offline(smol_folder, monkeypatch, tmp_path)


def assert_same_tokens(ours: Tokenizer, hf, texts) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.encode(text) == ours.encode(text, add_special_tokens=True), text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
        assert hf.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text


def assert_same_chat(ours: Tokenizer, hf, conversation) -> None:
    for generation_prompt in (True, False):
        text = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
        assert hf.apply_chat_template(conversation, tokenize=False,
                                      add_generation_prompt=generation_prompt) == text
        ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                     add_generation_prompt=generation_prompt)
        assert list(ids) == ours.encode(text)


@pytest.mark.model
def test_folder_holds_the_files_transformers_reads(smol_folder):
    assert sorted(p.name for p in smol_folder.iterdir()) == sorted(FILES)
    cfg = json.loads((smol_folder / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == TOKENIZER_CLASS and cfg["model_max_length"] == 8192
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")  # the GGUF's padding_token_id is 2
    assert cfg["chat_template"].startswith("{% for message in messages %}")
    specials = json.loads((smol_folder / "special_tokens_map.json").read_text())
    assert specials["unk_token"] == "<|endoftext|>"
    assert "<file_sep>" in specials["additional_special_tokens"]


@pytest.mark.model
def test_transformers_tokenizes_like_ours(smol, theirs):
    # the KNOWN_DIFFERENT texts of test_tokenizer.py (non-ASCII numerals) tokenize
    # differently in transformers' own GGUF converter; through this folder they agree too
    assert_same_tokens(smol, theirs, TEXTS + EXTRA_TEXTS)
    assert len(theirs) == smol.vocab_size == 49152


@pytest.mark.model
def test_special_tokens_and_ids_agree(smol, theirs):
    assert theirs.bos_token_id == smol.bos_token_id == 1
    assert theirs.eos_token_id == smol.eos_token_ids[0] == 2
    assert theirs.pad_token_id == 2 and theirs.unk_token_id == 0
    ours_special = {i for i in range(smol.vocab_size) if smol.is_special(i)}
    assert set(theirs.all_special_ids) == ours_special


@pytest.mark.model
def test_chat_template_renders_like_ours(smol, theirs):
    assert_same_chat(smol, theirs, CONVERSATION)
    assert_same_chat(smol, theirs, CONVERSATION[1:])  # the template adds its default system


def test_tiny_gguf_without_padding_token_pads_with_eos(tmp_path, monkeypatch):
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(gguf)
    export_tokenizer(str(tmp_path / "out"), gguf)
    ours, hf = read_gguf_tokenizer(gguf), load_offline(tmp_path / "out", monkeypatch, tmp_path)
    assert hf.pad_token_id == hf.eos_token_id == ours.eos_token_ids[0]
    assert hf.model_max_length == 256  # the GGUF's context length
    assert_same_tokens(ours, hf, TEXTS)
    assert_same_chat(ours, hf, CONVERSATION)


def test_hugging_face_folder_exports_the_same_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    export_tokenizer(str(tmp_path / "out"), str(tiny_model_dir))
    ours = Tokenizer.from_hf_folder(str(tiny_model_dir))
    hf = load_offline(tmp_path / "out", monkeypatch, tmp_path)
    assert hf.model_max_length == 512  # config.json's max_position_embeddings
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert_same_tokens(ours, hf, TEXTS)
    assert_same_chat(ours, hf, CONVERSATION)


def test_command_line_writes_the_folder(tmp_path):
    gguf = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(gguf)
    out = tmp_path / "tok"
    done = subprocess.run([sys.executable, "-m", "runtime", "export-tokenizer", str(out),
                           "--model", gguf], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(out / name) for name in FILES]
    missing = subprocess.run([sys.executable, "-m", "runtime", "export-tokenizer", str(out),
                              "--model", str(tmp_path / "absent.gguf")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr
