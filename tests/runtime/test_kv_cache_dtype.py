"""The KV cache's element type (`kv_cache_dtype`): what `auto` picks, what a choice costs in
memory, the values refused, and every place KV leaves the cache (the disk tier, block copies)
keeping its dtype. A float16 cache's accuracy against transformers is tested in
tests/runtime/test_vs_transformers.py."""
from __future__ import annotations

import pytest
import torch

import kernels
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from kernels import cpu_ops
from runtime.execution.runner import resolve_kv_dtype

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(not kernels.cpu_ops_take(torch.float32), reason="no compiled CPU ops")
def test_auto_is_float16_under_a_float32_model_on_the_cpu(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=None, kv_cache_bytes=1 << 20)
    assert engine.runner.kv_dtype == torch.float16
    assert all(k.dtype == v.dtype == torch.float16 for k, v in engine.runner.kv_caches)
    wide = make_tiny_engine(num_blocks=None, kv_cache_bytes=1 << 20, kv_cache_dtype="float32")
    assert wide.runner.kv_dtype == torch.float32
    # the same memory holds twice the tokens
    assert engine.runner.num_blocks == 2 * wide.runner.num_blocks


def test_auto_keeps_the_model_dtype_where_triton_runs(monkeypatch):
    monkeypatch.setattr(kernels, "FORCE_TRITON", True)
    assert resolve_kv_dtype(EngineConfig(), torch.float32) == torch.float32
    assert resolve_kv_dtype(EngineConfig(device="cuda"), torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="Triton kernels read only the model's dtype"):
        resolve_kv_dtype(EngineConfig(device="cuda", kv_cache_dtype="float16"), torch.bfloat16)


def test_auto_keeps_float32_with_the_kernels_off(monkeypatch):
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    assert resolve_kv_dtype(EngineConfig(), torch.float32) == torch.float32


@pytest.mark.parametrize("bad", ["half", "fp8", "", "Float16"])
def test_unknown_dtypes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, "
                                         "float16, bfloat16"):
        EngineConfig(kv_cache_dtype=bad)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_each_dtype_serves_and_its_blocks_copy_out_and_back(make_tiny_engine, kv_dtype):
    """A request runs on the cache, and a block read out (what the disk tier saves and
    disaggregated serving sends) keeps the dtype and writes back unchanged."""
    engine = make_tiny_engine(kv_cache_dtype=kv_dtype)
    prompt = engine.tokenizer.encode("The history of the Roman Empire")
    out = engine.generate([prompt], GREEDY)[0]
    assert len(out) == 8
    runner = engine.runner
    # a block the request wrote, copied into one it never touched: the copy must move data
    used = [b for b in range(runner.num_blocks) if runner.read_block(b).any()]
    unused = next(b for b in range(runner.num_blocks) if b not in used)
    block = runner.read_block(used[0])
    assert block.dtype == getattr(torch, kv_dtype) and block.shape == runner.block_shape
    runner.write_block(unused, block)
    assert torch.equal(runner.read_block(unused), block)


@pytest.mark.skipif(not cpu_ops.available(), reason="no compiled CPU ops")
def test_float16_and_float32_caches_agree_on_greedy_tokens(make_tiny_engine):
    """The same requests on the two caches: the float16 rounding of K and V moves no token of
    this model's short greedy runs."""
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "Water boils at"]
    runs = {}
    for kv_dtype in ("float32", "float16"):
        engine = make_tiny_engine(kv_cache_dtype=kv_dtype)
        runs[kv_dtype] = engine.generate([engine.tokenizer.encode(p) for p in prompts], GREEDY)
    assert runs["float16"] == runs["float32"]
