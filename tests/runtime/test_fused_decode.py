"""The fused CPU decode layer (kernels/cpu_layer.py) gives the op-by-op engine's tokens, runs
only the steps it can, and steps aside for everything else."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import kernels
from contract.sampling_params import SamplingParams
from kernels import cpu_build, cpu_ops
from kernels.cpu_layer import BLOCK_MAX_ROWS, FusedDecoder
from testkit.q4_weights import snapped_to_q4_1

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")

PROMPTS = ["The quick brown fox", "Paris is the capital of",
           "Caching the prefix of a prompt saves compute for every request that repeats it.",
           "a", "one two three four five six seven eight nine ten eleven twelve"]


def engine(make_tiny_engine, monkeypatch, fused: bool, **overrides):
    monkeypatch.setattr(kernels, "NO_FUSED_LAYER", not fused)
    cfg = dict(quantization="int8", quant_max_rows=16, max_num_batched_tokens=16)
    cfg.update(overrides)
    return make_tiny_engine(**cfg)


def count_calls(monkeypatch, owner, name) -> list[int]:
    calls = [0]
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def run(eng, prompts, params) -> dict[str, tuple[list[int], list]]:
    """Each request's tokens and per-token logprob entries, keyed by its place."""
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    got: dict[str, tuple[list[int], list]] = {str(i): ([], []) for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step()[0]:
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.logprobs or [])
    return got


def fused_batch_sizes(eng, monkeypatch) -> list[int]:
    """The row count of every step the engine's fused decoder runs from now on."""
    sizes: list[int] = []
    real = eng.runner.model.fused.forward

    def spy(x, meta, kv_caches):
        sizes.append(x.shape[0])
        return real(x, meta, kv_caches)
    monkeypatch.setattr(eng.runner.model.fused, "forward", spy)
    return sizes


def test_fused_steps_give_the_op_by_op_tokens_and_logprobs(make_tiny_engine, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = engine(make_tiny_engine, monkeypatch, fused=False)
    assert plain.runner.model.fused is None
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    expected = run(plain, prompts, params)

    fused_engine = engine(make_tiny_engine, monkeypatch, fused=True)
    model = fused_engine.runner.model
    assert model.fused is not None and model.fused.max_rows == 16
    fused_calls = count_calls(monkeypatch, model.fused, "forward")
    layer_calls = count_calls(monkeypatch, type(model.layers[0]), "forward")
    got = run(fused_engine, prompts, params)
    assert fused_calls[0] > 0  # decode-only steps ran fused
    assert layer_calls[0] > 0  # prefill chunks (16-token budget) ran op by op
    for key, (tokens, logprobs) in expected.items():
        assert got[key][0] == tokens and len(tokens) == 24
        assert len(got[key][1]) == len(logprobs) == 24
        for a, b in zip(got[key][1], logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_batch_large_enough_for_the_panel_kernel_gives_the_same_tokens(make_tiny_engine,
                                                                        monkeypatch):
    """34 decodes at once: every projection of the fused layer runs from its panels
    (cpu_ops.PANEL_MIN_ROWS), and the tokens are the op-by-op engine's."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # the inter-token budget off: all 34 prompts prefill in one step, so all decode together
    many = dict(quant_max_rows=64, max_num_seqs=40, num_blocks=256, max_num_batched_tokens=512,
                itl_target_ms=0)
    plain = engine(make_tiny_engine, monkeypatch, fused=False, **many)
    prompts = [plain.tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} {i}") for i in range(34)]
    expected = plain.generate(prompts, params)
    eng = engine(make_tiny_engine, monkeypatch, fused=True, **many)
    sizes = fused_batch_sizes(eng, monkeypatch)
    assert eng.generate(prompts, params) == expected
    assert max(sizes) == 34 >= cpu_ops.PANEL_MIN_ROWS


@pytest.fixture
def make_4bit_engine(tiny_checkpoint, monkeypatch):
    """The tiny model with its layers' matrices rounded to Q4_1 (as a 4-bit GGUF holds them),
    served with int4: those matrices keep their 4-bit form (the embeddings stay int8)."""
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    weights = {name: snapped_to_q4_1(w) if ".layers." in name and w.dim() == 2 else w
               for name, w in tiny_checkpoint.weights.items()}
    checkpoint = dataclasses.replace(tiny_checkpoint, weights=weights)

    def make(fused: bool, **overrides):
        monkeypatch.setattr(kernels, "NO_FUSED_LAYER", not fused)
        cfg = dict(num_blocks=64, block_size=4, max_num_seqs=16, quantization="int4",
                   quant_max_rows=16, max_num_batched_tokens=16)
        cfg.update(overrides)
        return LLMEngine(checkpoint, EngineConfig(**cfg))
    return make


def test_4bit_fused_steps_give_the_op_by_op_tokens_and_logprobs(make_4bit_engine, monkeypatch):
    """The fused layer reads each matrix's 4-bit form (no float copy: every step size), as the
    op-by-op path does, and both give the same tokens and logprobs."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_4bit_engine(fused=False)
    qkv = plain.runner.model.layers[0].qkv
    assert qkv.small is not None and qkv.small.exact and qkv.dense is None
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    expected = run(plain, prompts, params)
    eng = make_4bit_engine(fused=True)
    weights = eng.runner.model.fused.weights[0]
    assert weights.qkv.qs and not weights.down.dense  # the C layer got the 4-bit form alone
    small_calls = count_calls(monkeypatch, type(qkv.small), "matmul")
    sizes = fused_batch_sizes(eng, monkeypatch)
    got = run(eng, prompts, params)
    assert sizes and small_calls[0] > 0  # decodes fused, prefill chunks op by op in 4 bits
    for key, (tokens, logprobs) in expected.items():
        assert got[key][0] == tokens
        for a, b in zip(got[key][1], logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_4bit_decode_steps_of_any_size_run_the_blocks_fused(make_4bit_engine, monkeypatch):
    """No float copy is kept, so no crossover bounds the fused layer: decode steps of every
    size run the 4-bit blocks in C (the kernel's panels from a few rows up), and the tokens
    are the op-by-op engine's (the same kernel)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = make_4bit_engine(fused=False, quant_max_rows=1)
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    expected = plain.generate(prompts, params)
    eng = make_4bit_engine(fused=True, quant_max_rows=1)
    assert eng.runner.model.fused.max_rows == BLOCK_MAX_ROWS
    sizes = fused_batch_sizes(eng, monkeypatch)
    assert eng.generate(prompts, params) == expected
    assert max(sizes) == len(PROMPTS)


def test_steps_larger_than_the_int8_crossover_run_op_by_op(make_tiny_engine, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = engine(make_tiny_engine, monkeypatch, fused=False, quant_max_rows=2)
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    expected = plain.generate(prompts, params)
    eng = engine(make_tiny_engine, monkeypatch, fused=True, quant_max_rows=2)
    sizes = fused_batch_sizes(eng, monkeypatch)
    assert eng.generate(prompts, params) == expected
    assert sizes and max(sizes) <= 2


def test_takes_only_decode_steps_of_float32_within_the_crossover(make_tiny_engine, monkeypatch):
    fused = engine(make_tiny_engine, monkeypatch, fused=True).runner.model.fused
    caches = [(torch.zeros(8, 2, 16), torch.zeros(8, 2, 16))]
    f32 = torch.zeros(1)
    decode = SimpleNamespace(num_chunks=0, num_decode=3, cos=f32)
    assert fused.takes(decode, 3, caches)
    assert not fused.takes(SimpleNamespace(num_chunks=1, num_decode=3, cos=f32), 4, caches)
    assert not fused.takes(SimpleNamespace(num_chunks=0, num_decode=17, cos=f32), 17, caches)
    assert not fused.takes(SimpleNamespace(num_chunks=0, num_decode=3,
                                           cos=f32.bfloat16()), 3, caches)


def test_models_the_layer_cannot_run_get_none(make_tiny_engine, monkeypatch):
    float_model = engine(make_tiny_engine, monkeypatch, fused=True,
                         quantization="none").runner.model
    assert float_model.fused is None  # float weights: no int8 matrices to read
    layers = engine(make_tiny_engine, monkeypatch, fused=True).runner.model.layers
    assert FusedDecoder.build(layers, torch.bfloat16) is None
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    assert kernels.fused_decoder(layers, torch.float32) is None
