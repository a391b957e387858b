"""Gemma 3's sliding-window layers past their window run in the C attention kernels, not the
torch reference path: the tiny Gemma 3 (testkit/family_models.py, a 32-token window) against
transformers with runtime/models/window_attention.py's path made to fail, prompts and decodes
reaching well past the window, chunked so that a chunk straddles it."""
from __future__ import annotations

import pytest
import torch

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from kernels import cpu_ops
from testkit.family_models import reference_greedy, write_family_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no compiled CPU ops")


def test_windowed_layers_run_in_the_kernels(tmp_path, monkeypatch):
    import runtime.models.attention as attention
    from runtime.engine import LLMEngine

    def refuse(*_a, **_k):
        raise AssertionError("the torch window path ran where the C kernels take the window")

    monkeypatch.setattr(attention, "windowed_attention", refuse)
    reference = write_family_checkpoint(tmp_path, "gemma3")
    engine = LLMEngine.from_model_path(str(tmp_path), EngineConfig(
        num_blocks=256, block_size=4, max_num_batched_tokens=40, max_num_seqs=4,
        kv_cache_dtype="float32"))
    try:
        prompts = [list(range(5, 105)), [7, 9, 11] * 20]
        for ids in prompts:
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0]
            ours = engine.prompt_logits(ids)
            # float32 both sides (tests/runtime/test_families.py's rule)
            assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4
        got = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                      ignore_eos=True))
        for ids, tokens in zip(prompts, got):
            assert tokens == reference_greedy(reference, ids, 20)
    finally:
        engine.close()
