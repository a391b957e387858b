"""`kernels/__init__.py` picks per call; the runtime's own calls work on the Triton path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels
from contract.sampling_params import SamplingParams
from kernels.rotary import apply_rotary_ref

# what the runtime launches: decode straight from block tables, every chunk in one varlen call
LAUNCHERS = ["rms_norm_triton", "apply_rotary_triton", "silu_and_mul_triton", "store_kv_triton",
             "paged_decode_attention_triton", "prefill_attention_varlen_triton"]
CUDA_TENSOR = SimpleNamespace(is_cuda=True)  # all use_triton looks at


def test_triton_for_cuda_tensors_reference_elsewhere(monkeypatch):
    monkeypatch.setattr(kernels, "FORCE_TRITON", False)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
    assert not kernels.use_triton(torch.zeros(1))
    assert kernels.use_triton(CUDA_TENSOR) == kernels.HAS_TRITON


def test_environment_variable_forces_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    assert not kernels.use_triton(CUDA_TENSOR)


def test_cpu_calls_take_the_compiled_ops_unless_forced_to_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "FORCE_TRITON", False)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    x = torch.randn(3, 2, 8)
    cos, sin = kernels.rotary_cos_sin(torch.arange(3), 8, 10000.0, torch.float32)
    expected = apply_rotary_ref(x, cos, sin)
    out = kernels.apply_rotary(x, cos, sin)
    assert out.data_ptr() != x.data_ptr()  # the reference returns a new tensor
    assert torch.equal(out, expected)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
    if not kernels.cpu_ops.available():
        pytest.skip(f"no compiled CPU ops here: {kernels.cpu_build.unavailable_reason()}")
    out = kernels.apply_rotary(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # the C op rotates in place, as Triton's does
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # a dtype the C ops do not take still goes to the reference
    assert not kernels.use_cpu_ops(torch.zeros(1, dtype=torch.bfloat16))


def test_tiny_model_generates_the_same_tokens_through_the_kernels(device, make_tiny_engine,
                                                                  monkeypatch):
    """Every op of the runtime (strided qkv views, in-place rotary, chunked prefill over a
    cached prefix, decode over pages) through the Triton path, greedy tokens unchanged."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = ["The quick brown fox", "Paris is the capital of",
             "Caching the prefix of a prompt saves compute for every request that repeats it."]
    launches = {}
    for name in LAUNCHERS:
        real = getattr(kernels, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            launches[_name] = launches.get(_name, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)

    def run(triton: bool):
        monkeypatch.setattr(kernels, "FORCE_TRITON", triton)
        monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
        engine = make_tiny_engine(max_num_batched_tokens=8)  # prompts cut into chunks
        prompts = [engine.tokenizer.encode(t) for t in texts]
        return engine.generate(prompts, params)

    if device.type == "cuda":
        pytest.skip("the tiny engine runs on the CPU; on CUDA the runtime's own tests use it")
    expected = run(False)
    assert launches == {}
    assert run(True) == expected
    assert set(launches) == set(LAUNCHERS)


def test_per_step_plans_follow_the_choice(monkeypatch):
    """What attention reads besides the tables is built by the chosen path: the references'
    slots on the CPU, nothing for the Triton kernels (which read the tables themselves)."""
    tables, lens = torch.tensor([[3, 1, 0]]), torch.tensor([5])
    starts, prefix = torch.tensor([0, 2]), torch.tensor([3])
    monkeypatch.setattr(kernels, "FORCE_TRITON", False)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    slots, valid = kernels.decode_slots(tables, lens, 4, max_len=5)
    assert slots.tolist() == [[12, 13, 14, 15, 4]] and valid.all()
    [(first, end, cached, ctx)] = kernels.prefill_plan(tables, 4, starts, prefix)
    assert (first, end, cached, ctx.tolist()) == (0, 2, 3, [12, 13, 14, 15, 4])
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
    if kernels.cpu_ops.available():  # the C attention ops read the tables themselves
        assert kernels.decode_slots(tables, lens, 4, max_len=5) == (None, None)
        slots, _ = kernels.decode_slots(tables, lens, 4, max_len=5, dtype=torch.bfloat16)
        assert slots is not None  # bfloat16 queries go to the reference
        assert kernels.prefill_plan(tables, 4, starts, prefix) is None
        assert kernels.prefill_plan(tables, 4, starts, prefix, torch.bfloat16) is not None
    if kernels.HAS_TRITON:
        monkeypatch.setattr(kernels, "FORCE_TRITON", True)
        assert kernels.decode_slots(tables, lens, 4, max_len=5) == (None, None)
        assert kernels.prefill_plan(tables, 4, starts, prefix) is None
