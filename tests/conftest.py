"""Shared fixtures: the tiny random model (fast tests) and the real SmolLM2 model (marked), and
the hooks of the two tiers (testkit/tiers.py: `make test-fast` deselects what needs the model,
services or a process, and fails a fast test that starts one)."""
from __future__ import annotations

import os

import pytest

from testkit.tiers import (  # noqa: F401  (pytest finds hooks by name in a conftest)
    pytest_collection_modifyitems,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_sessionstart,
)
from testkit.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Keep the suite's crossover tables out of the user's home, shared across the session."""
    os.environ.setdefault("INFERSTACK_CACHE_DIR", str(tmp_path_factory.mktemp("weight-cache")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir):
    from runtime.loading.loader import load_checkpoint
    return load_checkpoint(str(tiny_model_dir))


@pytest.fixture
def make_tiny_engine(tiny_checkpoint):
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine

    def make(**overrides):
        cfg = dict(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=16)
        cfg.update(overrides)
        return LLMEngine(tiny_checkpoint, EngineConfig(**cfg))
    return make


@pytest.fixture(scope="session")
def smollm_checkpoint():
    from runtime.loading.loader import default_model_path, load_checkpoint
    return load_checkpoint(default_model_path())


@pytest.fixture(scope="session")
def smollm_engine(smollm_checkpoint):
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    # the float path, float32 weights and cache: tests compare it with transformers on the
    # file's own dequantized weights (the quantized path and the float16 cache have their own,
    # tests/runtime/test_quantization.py and test_vs_transformers.py)
    return LLMEngine(smollm_checkpoint, EngineConfig(kv_cache_bytes=256 << 20,
                                                     max_num_batched_tokens=256,
                                                     quantization="none",
                                                     kv_cache_dtype="float32"))


@pytest.fixture(scope="session")
def hf_smollm():
    """Hugging Face transformers loading the same SmolLM2 GGUF: our reference (loaded once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.loading.loader import default_model_path
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
