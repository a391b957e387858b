"""The 8-bit KV cache (`kv_cache_dtype` int8, kernels/kv_int8.py) through the engine on the
tiny model: its rows and scales in the pool and in every copy of a block (the disk tier, PD
transfers), its prefix-cache root apart from a float cache's, the tokens `--kv-cache-gb` buys,
latent attention on it, and what is refused. The kernels' arithmetic is tested in
tests/kernels/test_cpu_attention_int8.py, accuracy on the real model in
tests/runtime/test_kv_int8_model.py."""
from __future__ import annotations

import os

import pytest
import torch

from contract.block_hashing import block_hashes, root_hash
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.execution.runner import resolve_kv_dtype
from runtime.kv.cache_format import kv_bytes_per_token
from tests.scaleout.harness import Pair

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * j) % 200 + 5 for j in range(33)]


def test_rows_hold_values_and_scales_and_blocks_copy_out_and_back(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_dtype="int8")
    runner, cfg = engine.runner, engine.model_config
    assert runner.kv_dtype == torch.int8
    for k, v in runner.kv_caches:
        assert k.dtype == v.dtype == torch.int8 and k.shape[-1] == cfg.head_dim + 4
    out = engine.generate([PROMPT], GREEDY)[0]
    assert len(out) == 8
    used = [b for b in range(runner.num_blocks) if runner.read_block(b).any()]
    unused = next(b for b in range(runner.num_blocks) if b not in used)
    block = runner.read_block(used[0])
    assert block.dtype == torch.int8 and block.shape == runner.block_shape
    scales = block[..., -4:].contiguous().view(torch.float32)
    assert (scales > 0).all()  # every written row carries its own scale
    runner.write_block(unused, block)
    assert torch.equal(runner.read_block(unused), block)


def test_the_same_memory_holds_more_tokens(make_tiny_engine):
    sizes = {}
    for kv_dtype in ("float16", "int8"):
        engine = make_tiny_engine(num_blocks=None, kv_cache_bytes=4 << 20,
                                  kv_cache_dtype=kv_dtype)
        sizes[kv_dtype] = engine.runner.num_blocks
        per_token = kv_bytes_per_token(engine.model_config, engine.runner.kv_dtype)
        cache = engine.runner.kv_caches[0][0]
        assert per_token == 2 * len(engine.runner.kv_caches) * cache[0].numel() * \
            cache.element_size()
    d = make_tiny_engine().model_config.head_dim
    # 2 d bytes a row against d + 4 (the block count rounds down)
    assert sizes["int8"] == pytest.approx(sizes["float16"] * 2 * d / (d + 4), abs=1)


def test_the_prefix_root_keeps_int8_blocks_apart(make_tiny_engine):
    """The engine's model id (the hash root's model part, sent in its Ready frame) names the
    cache type, so a float cache's block hash never names an int8 block, on disk or in a
    gateway's index."""
    f16 = make_tiny_engine(kv_cache_dtype="float16")
    i8 = make_tiny_engine(kv_cache_dtype="int8")
    assert "kv:torch.int8" in i8.model_id and f16.model_id != i8.model_id
    hashes = [block_hashes(root_hash(e.model_id, None), PROMPT, 4) for e in (f16, i8)]
    assert not set(hashes[0]) & set(hashes[1])
    # the KV events a gateway indexes name the int8 chain (its Ready frame's model id)
    i8.generate([PROMPT], GREEDY)
    events = i8.drain_kv_events()
    assert events is not None and {h.hex() for h in hashes[1]} <= set(events.stored)


def test_disk_tier_keeps_scales_and_serves_only_int8(make_tiny_engine, tmp_path):
    disk = str(tmp_path / "kv")
    first = make_tiny_engine(kv_cache_dtype="int8", disk_cache_dir=disk, num_blocks=13)
    expected = first.generate([PROMPT], GREEDY)[0]
    first.close()  # every cached block written
    assert first.disk_cache.stats.writes >= len(PROMPT) // 4
    files = sorted(os.listdir(disk))
    other = make_tiny_engine(kv_cache_dtype="float16", disk_cache_dir=disk, num_blocks=13)
    other.generate([PROMPT], GREEDY)
    assert other.disk_cache.stats.reads == 0 and other.disk_cache.stats.corrupt == 0
    other.close()
    assert set(files) <= set(os.listdir(disk))  # the int8 files were left alone
    again = make_tiny_engine(kv_cache_dtype="int8", disk_cache_dir=disk, num_blocks=13)
    assert again.generate([PROMPT], GREEDY)[0] == expected
    assert again.disk_cache.stats.reads == len(PROMPT) // 4
    again.close()


def test_pd_transfer_moves_rows_with_their_scales(make_tiny_engine):
    reference = make_tiny_engine(kv_cache_dtype="int8").generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    pair = Pair(lambda: make_tiny_engine(kv_cache_dtype="int8"))
    try:
        sent = []
        p_engine = pair.workers["p"].engine
        export = p_engine.export_request
        p_engine.export_request = lambda rid: [sent.append(b.clone()) or b
                                               for b in export(rid)]
        params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        first = pair.prefill("r", PROMPT, params)
        pair.handoff("r", PROMPT, params, first)
        rest, _, transfer = pair.decode_rest("r")
        assert first["tokens"] + rest == reference
        assert transfer["bytes"] == sum(b.numel() for b in sent)  # int8: a byte an element
        assert all(b.dtype == torch.int8 for b in sent)
    finally:
        pair.close()


def test_pd_transfer_between_cache_types_is_refused_by_name(make_tiny_engine):
    engines = iter([make_tiny_engine(kv_cache_dtype="float16"),
                    make_tiny_engine(kv_cache_dtype="int8")])
    pair = Pair(lambda: next(engines))
    try:
        params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        first = pair.prefill("r", PROMPT, params)
        pair.handoff("r", PROMPT, params, first)
        with pytest.raises(AssertionError, match="KV blocks are float16 .* this worker's int8"):
            pair.decode_rest("r")
    finally:
        pair.close()


PROMPTS = [PROMPT, PROMPT[:9], [5] * 20]


def _tokens(make_tiny_engine, **kw):
    engine = make_tiny_engine(kv_cache_dtype="int8", max_num_batched_tokens=16, **kw)
    return engine, engine.generate(PROMPTS, GREEDY)  # chunked prefill, then decodes


def test_the_torch_fallback_reads_the_same_cache(make_tiny_engine, monkeypatch):
    """The references (kernels off) quantize and dequantize the very bytes the C ops write
    and read: the same greedy tokens through either path."""
    import kernels
    _, ours = _tokens(make_tiny_engine)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", True)
    assert _tokens(make_tiny_engine)[1] == ours


def test_the_fused_decode_layer_stores_and_reads_int8_rows(make_tiny_engine, monkeypatch):
    """Decode steps through the fused C layer (int8 weights up to 16 rows, as
    tests/runtime/test_fused_decode.py forces it) against the op-by-op C ops."""
    import kernels
    fused, ours = _tokens(make_tiny_engine, quantization="int8", quant_max_rows=16)
    calls = []
    forward = fused.runner.model.fused.forward
    fused.runner.model.fused.forward = lambda *a: calls.append(1) or forward(*a)
    assert fused.generate(PROMPTS, GREEDY) == ours and calls  # it ran the decode steps
    monkeypatch.setattr(kernels, "NO_FUSED_LAYER", True)
    op_by_op, theirs = _tokens(make_tiny_engine, quantization="int8", quant_max_rows=16)
    assert op_by_op.runner.model.fused is None and theirs == ours


def test_int8_is_for_the_cpu_kernels_only():
    with pytest.raises(ValueError, match="int8: the Triton kernels read only"):
        resolve_kv_dtype(EngineConfig(device="cuda", kv_cache_dtype="int8"), torch.bfloat16)
    assert resolve_kv_dtype(EngineConfig(kv_cache_dtype="int8"), torch.float32) == torch.int8


def test_latent_attention_runs_on_an_int8_cache(tmp_path):
    """DeepSeek's latent rows (K and V one tensor) quantized a row at a time: the kernels
    read them as any int8 cache; the logits stay close to transformers'."""
    pytest.importorskip("transformers")
    from runtime.engine import LLMEngine
    from runtime.loading.loader import load_checkpoint
    from testkit.family_models import write_family_checkpoint
    reference = write_family_checkpoint(tmp_path / "ds", "deepseek_v3")
    engine = LLMEngine(load_checkpoint(str(tmp_path / "ds")), EngineConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
        kv_cache_dtype="int8"))
    try:
        cfg = engine.model_config
        k, v = engine.runner.kv_caches[0]
        assert k.data_ptr() == v.data_ptr() and k.shape[-1] == cfg.kv_cache_dim + 4
        ids = list(range(5, 45))
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        # each latent value within absmax / 254 of its row's largest (float16: 2^-11 of
        # itself, tested below 1e-2): eight times the float16 cache's bound
        assert float((ours - ref).abs().max() / ref.abs().max()) < 8e-2
        assert len(engine.generate([ids], GREEDY)[0]) == 8
    finally:
        engine.close()
