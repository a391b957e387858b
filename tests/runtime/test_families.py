"""Every family we serve against transformers' own implementation of it, on the same random
weights (testkit/family_models.py): prompt logits within float32 tolerance and the same greedy
tokens, through the whole engine (loader, paged cache, chunked prefill, decode steps)."""
from __future__ import annotations

import pytest
import torch

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from testkit.family_models import FAMILIES, reference_greedy, write_family_checkpoint
from testkit.tolerances import relative_error

pytest.importorskip("transformers")

# the longest crosses Gemma's 32-token test window several times, and the chunk budget below
PROMPTS = [
    "The history of the Roman Empire",
    "Paris is the capital of France, and Berlin is the capital of Germany. " * 4,
    "def add(a, b):\n    return a + b\n" * 3,
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = write_family_checkpoint(folder, request.param)
    from runtime.engine import LLMEngine
    engine = LLMEngine.from_model_path(str(folder), EngineConfig(
        num_blocks=128, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
        kv_cache_dtype="float32"))
    yield request.param, engine, reference
    engine.close()


def test_prompt_logits_match_transformers(family):
    name, engine, reference = family
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text)
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        # float32 on both sides, sums of at most a few hundred terms per layer: 1e-4 of the
        # largest logit is far above their rounding and far below any mistake in the formula
        assert relative_error(ours, ref) < 1e-4, (name, text[:30])


def test_greedy_tokens_match_transformers(family):
    name, engine, reference = family
    ids = [engine.tokenizer.encode(t) for t in PROMPTS]
    ours = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, tokens in zip(ids, ours):
        assert tokens == reference_greedy(reference, prompt, 24), name
