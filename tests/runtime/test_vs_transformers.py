"""Against a reference we did not write: Hugging Face transformers on the same weights."""

import pytest
import torch

from runtime.sampling_params import SamplingParams

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "List three colours of the rainbow:",
]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


# ---- tiny random model (fast) -------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: a random model hits it early
    return model


def test_tiny_prompt_logits_match_transformers(make_tiny_engine, hf_tiny):
    engine = make_tiny_engine()
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text)
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            ref = hf_tiny(torch.tensor([ids])).logits[0]
        assert relative_error(ours, ref) < 1e-4


def test_tiny_greedy_tokens_match_transformers(make_tiny_engine, hf_tiny):
    engine = make_tiny_engine()
    ids = [engine.tokenizer.encode(t) for t in PROMPTS]
    ours = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for p, o in zip(ids, ours):
        ref = hf_tiny.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o == ref[0, len(p):].tolist()


# ---- the real SmolLM2 GGUF ------------------------------------------------------------------
@pytest.mark.model
def test_smollm_prompt_logits_match_transformers(smollm_engine, hf_smollm):
    tok = smollm_engine.tokenizer
    texts = PROMPTS + [tok.apply_chat_template([{"role": "user", "content": "Hi there!"}])]
    for text in texts:
        ids = tok.encode(text)
        ours = smollm_engine.prompt_logits(ids)
        with torch.no_grad():
            ref = hf_smollm(torch.tensor([ids])).logits[0]
        assert relative_error(ours, ref) < 1e-3, text


@pytest.mark.model
def test_smollm_32_greedy_tokens_match_transformers(smollm_engine, hf_smollm):
    tok = smollm_engine.tokenizer
    ids = [tok.encode(t) for t in PROMPTS]
    ours = smollm_engine.generate(ids, SamplingParams(max_tokens=32, temperature=0.0))
    for p, o in zip(ids, ours):
        assert o == hf_greedy(hf_smollm, p, 32)


@pytest.mark.model
def test_smollm_knows_the_capital_of_france(smollm_engine):
    tok = smollm_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "What is the capital of France?"}])
    out = smollm_engine.generate([tok.encode(prompt)],
                                 SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert "Paris" in tok.decode(out)
