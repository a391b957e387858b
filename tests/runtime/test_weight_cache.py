"""Weight cache: a second load comes from the cache and is identical; corrupt files are rebuilt."""
from __future__ import annotations

import os
import time

import pytest
import torch

from runtime.loading import weight_cache
from runtime.loading.loader import default_model_path, load_checkpoint
from tests.runtime.test_gguf_loader import write_tiny_gguf


@pytest.fixture
def gguf_path(tmp_path):
    path = str(tmp_path / "tiny-llama.Q4_1.gguf")
    write_tiny_gguf(path)
    return path


def assert_same(a, b):
    assert a.config == b.config
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name]), name
    text = "<|im_start|>user\nHi 🙂<|im_end|>"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.chat_template == b.tokenizer.chat_template


def test_second_load_is_cached_and_equal(gguf_path, tmp_path):
    cache = str(tmp_path / "cache")
    first = load_checkpoint(gguf_path, cache_dir=cache)
    second = load_checkpoint(gguf_path, cache_dir=cache)
    assert not first.from_cache and second.from_cache
    assert os.listdir(cache) == [os.path.basename(weight_cache.cache_path(gguf_path, cache))]
    assert second.config.name == "tiny-llama" and second.config.eos_token_ids == (2,)
    assert_same(first, second)


def test_use_cache_false_neither_reads_nor_writes(gguf_path, tmp_path):
    cache = str(tmp_path / "cache")
    ckpt = load_checkpoint(gguf_path, cache_dir=cache, use_cache=False)
    assert not ckpt.from_cache and not os.path.exists(cache)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_cache_file_is_rebuilt(gguf_path, tmp_path, damage):
    cache = str(tmp_path / "cache")
    good = load_checkpoint(gguf_path, cache_dir=cache)
    path = weight_cache.cache_path(gguf_path, cache)
    with open(path, "rb") as f:
        data = f.read()
    broken = {"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}
    with open(path, "wb") as f:
        f.write(broken[damage])
    rebuilt = load_checkpoint(gguf_path, cache_dir=cache)
    assert not rebuilt.from_cache
    assert_same(good, rebuilt)
    assert load_checkpoint(gguf_path, cache_dir=cache).from_cache  # written again, whole


def test_changed_source_misses(gguf_path, tmp_path):
    cache = str(tmp_path / "cache")
    load_checkpoint(gguf_path, cache_dir=cache)
    old_key = weight_cache.cache_key(gguf_path)
    write_tiny_gguf(gguf_path, seed=1)
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))  # coarse mtime clocks
    assert weight_cache.cache_key(gguf_path) != old_key
    assert not load_checkpoint(gguf_path, cache_dir=cache).from_cache


def test_cache_dir_from_environment(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSTACK_CACHE_DIR", str(tmp_path / "env-cache"))
    assert weight_cache.resolve_cache_dir() == str(tmp_path / "env-cache")
    assert weight_cache.resolve_cache_dir(str(tmp_path / "x")) == str(tmp_path / "x")
    load_checkpoint(gguf_path)
    assert len(os.listdir(tmp_path / "env-cache")) == 1
    monkeypatch.delenv("INFERSTACK_CACHE_DIR")
    assert weight_cache.resolve_cache_dir() == os.path.expanduser("~/.cache/inferstack/weights")


def test_no_temp_files_left(gguf_path, tmp_path):
    cache = tmp_path / "cache"
    load_checkpoint(gguf_path, cache_dir=str(cache))
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]


@pytest.mark.model
def test_smollm_cached_load(tmp_path):
    cache = str(tmp_path / "cache")
    first = load_checkpoint(default_model_path(), cache_dir=cache)
    second = load_checkpoint(default_model_path(), cache_dir=cache)
    print(f"SmolLM2 load: first {first.load_seconds:.2f}s, cached {second.load_seconds:.2f}s")
    assert second.from_cache and not first.from_cache
    assert second.config.name == "SmolLM2-135M-Instruct"
    assert_same(first, second)
