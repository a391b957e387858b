"""Each family's tiny model written as llama.cpp's converter writes its GGUF
(testkit/family_gguf.py) and served from that file, against transformers on the same weights:
Llama 3.1's llama3 scaling read from the file's rope_freqs tensor, linear and YaRN scaling from
its rope keys, Qwen 3's q/k norms, Phi-3's fused projections; float32 files within float32
rounding, a Q8_0 file (served as its own blocks) against the weights the file holds."""
from __future__ import annotations

import gguf
import pytest
import torch

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from testkit.family_gguf import file_weights, write_family_gguf
from testkit.family_models import reference_greedy, write_family_checkpoint
from testkit.tolerances import relative_error

pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 42, 99, 123, 7, 64, 88] * 3, list(range(40, 110))]  # the second crosses 64,
# the llama3 test model's original context, where its frequency factors act


def _engine(path, quantization: str = "auto"):
    from runtime.engine import LLMEngine

    return LLMEngine.from_model_path(str(path), EngineConfig(
        num_blocks=128, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
        kv_cache_dtype="float32", quantization=quantization))


def _served(tmp_path, family: str, kind=Q.F32):
    folder = tmp_path / family
    reference = write_family_checkpoint(folder, family)
    path = tmp_path / f"{family}-{kind.name}.gguf"
    write_family_gguf(path, family, reference, folder / "tokenizer.json", kind)
    if kind != Q.F32:
        file_weights(reference, path)  # the reference holds what the file holds
    return _engine(path), reference


CASES = [(family, Q.F32) for family in ("llama3", "llama-linear", "llama-yarn", "qwen3", "phi3")]
CASES += [("llama3", Q.Q8_0), ("qwen3", Q.Q4_0), ("phi3", Q.Q4_0)]


@pytest.mark.parametrize(("family", "kind"), CASES, ids=lambda c: getattr(c, "name", c))
def test_family_gguf_matches_transformers(tmp_path, family, kind):
    engine, reference = _served(tmp_path, family, kind)
    try:
        if family == "llama3":  # the factors came from the file, not from a config
            assert engine.model_config.rope_scaling.frequency_factors
        if kind != Q.F32:  # served as the file's blocks, with no float copy
            for lin in engine.runner.model.linears():
                assert lin.small is not None and lin.dense is None, family
        for ids in PROMPTS:
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0]
            # float32 both sides, as tests/runtime/test_families.py: 1e-4 of the largest logit
            # is far above their rounding and far below a wrong frequency or layout (the
            # block kernels dequantize the weights and sum in float32: no activation rounding)
            assert relative_error(engine.prompt_logits(ids), ref) < 1e-4, family
        ours = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                       ignore_eos=True))
        for ids, tokens in zip(PROMPTS, ours):
            assert tokens == reference_greedy(reference, ids, 16), family
    finally:
        engine.close()
