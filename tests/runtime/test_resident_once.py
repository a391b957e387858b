"""Weights resident once (issue 31): a block-served model keeps no float copy of any matrix
(every Linear runs its blocks at every step size), its tensors add up to about the file's
matrices, and the tied embedding's rows are gathered from the head's blocks; a float
checkpoint keeps its one float copy; int8 per row (asked for) keeps its float copy for the
large steps its kernel runs slower."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from contract.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.loading.loader import load_checkpoint
from runtime.loading.quantization import Int8Weight
from runtime.models.linear import SMALL_STEP_ROWS, BlockRows, Linear
from tests.runtime.test_kquant_loading import write_kquant_gguf

C_KERNELS = pytest.mark.skipif(not kernels.cpu_ops_take(torch.float32),
                               reason="the block forms are served by the compiled CPU kernels")


def tensors_of(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every plain tensor reachable through an object's attributes (lists, tuples, dicts and
    slots included), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, BlockRows):
        return []  # no storage: a view of blocks found elsewhere
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_of(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_of(x, seen)]
    found = []
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
    for name in names:
        if hasattr(obj, name) and not name.startswith("__"):
            found += tensors_of(getattr(obj, name), seen)
    return found


@pytest.fixture(scope="module")
def kquant_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("resident") / "tiny-q4_k_m.gguf")
    write_kquant_gguf(path)
    cfg = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       quantization="int4")
    return path, LLMEngine(load_checkpoint(path), cfg)


@C_KERNELS
def test_no_linear_of_a_block_served_model_holds_a_float_copy(kquant_engine):
    path, engine = kquant_engine
    model = engine.runner.model
    for lin in model.linears():
        assert lin.small is not None and lin.packed is None
        assert lin.dense is None and lin.float_bytes == 0 and lin.max_small_rows > 1 << 30
        # scales are a block's few float16 numbers; a float copy would be N * K values
        n, k = lin.shape
        assert not [t for t in tensors_of(lin) if t.is_floating_point() and t.numel() >= n * k // 4]
    # the model's tensors: the blocks (the file's matrices; Q5_0's 22-byte blocks held as
    # 34-byte 8-bit ones) and the vectors, within the 1.2x of the file
    import os
    total = sum(t.numel() * t.element_size()
                for t in tensors_of([model.layers, model.lm_head, model.norm, model.embed]))
    assert total <= os.path.getsize(path) * 1.2


@C_KERNELS
def test_the_tied_embedding_rows_are_the_dequantized_rows(kquant_engine):
    _, engine = kquant_engine
    model = engine.runner.model
    ids = torch.tensor([5, 0, 17, 5, 263])
    want = model.lm_head.small.dequantized()[ids]
    assert torch.equal(model.lm_head.rows(ids), want)
    assert torch.equal(F.embedding(ids, model.lm_head.weight), want)  # the storage-less view
    assert isinstance(model.lm_head.weight, BlockRows)
    whole = []  # a lookup gathers its rows: it never dequantizes the whole weight
    blocks = model.lm_head.small
    dequantized = blocks.dequantized
    blocks.dequantized = lambda: whole.append(1) or dequantized()
    try:
        with torch.inference_mode():
            assert torch.equal(F.embedding(ids, model.lm_head.weight), want)
    finally:
        del blocks.dequantized
    assert not whole
    assert model.lm_head.weight.shape == model.lm_head.shape
    assert model.lm_head.weight.numel() == model.lm_head.shape[0] * model.lm_head.shape[1]
    x = torch.randn(3, model.lm_head.shape[1])  # any other use: the weights dequantized once
    torch.testing.assert_close(x @ model.lm_head.weight.T, model.lm_head(x),
                               rtol=1e-5, atol=1e-4)


def test_a_float_checkpoint_stays_float_once(make_tiny_engine):
    engine = make_tiny_engine(quantization="none")
    for lin in engine.runner.model.linears():
        assert lin.small is None and lin.packed is None and lin.dense is not None
        assert lin.weight is lin.dense


def test_int8_on_request_keeps_its_float_copy_for_large_steps():
    """int8 per row: its kernel runs every step size but measured 1.6-1.8x float32 GEMM's
    time from 128 tokens up, so the float copy stays for steps above the crossover."""
    w = torch.randn(64, 96)
    packed = Int8Weight(w)
    lin = Linear(packed.dequantized(), None, packed, max_quant_rows=4)
    assert lin.dense is not None and lin.float_bytes == 64 * 96 * 4
    x = torch.randn(SMALL_STEP_ROWS + 1, 96)  # up to SMALL_STEP_ROWS int8 runs anyway
    assert torch.equal(lin(x), F.linear(x, lin.dense))


def test_a_linear_needs_a_weight():
    with pytest.raises(ValueError):
        Linear(None)


@pytest.mark.model
@C_KERNELS
def test_smollm_is_resident_once():
    engine = LLMEngine(load_checkpoint(), EngineConfig(num_blocks=16, quantization="auto"))
    model = engine.runner.model
    assert model.quantization == "int4"
    assert sum(lin.float_bytes for lin in model.linears()) == 0
    blocks = sum(lin.small.nbytes for lin in model.linears())
    assert blocks < 100 << 20  # the 94 MiB file's matrices (was 513 MiB of float copies more)


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and head[-1] == path
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_copied_blocks_leave_the_file_pages_unmapped(tmp_path):
    """A Q4_0 matrix's fields are copied out of the file's interleaved blocks; the pages they
    were read from leave the resident set (they would double a worker's size), and reading
    the form again later still gives the file's weights."""
    import gguf
    import numpy as np

    from runtime.loading.gguf import open_gguf
    from testkit.tiny_gguf import llama_writer
    from tests.runtime.test_gguf_loader import byte_level_vocab

    path = str(tmp_path / "q4_0.gguf")
    tokens, merges = byte_level_vocab()
    writer = llama_writer(path, (tokens, merges), layers=1, hidden=256, ffn=8192, heads=4,
                          kv_heads=4)
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    big = rng.standard_normal((8192, 256), dtype=np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(big, Q.Q4_0),
                      raw_shape=gguf.quant_shape_to_byte_shape(big.shape, Q.Q4_0),
                      raw_dtype=Q.Q4_0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), 256),
                                                                dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, weights, _ = open_gguf(path)
    form = weights.blocks("model.layers.0.mlp.up_proj.weight")
    assert form is not None and form.nbytes > 1 << 20
    # the 1.1 MiB matrix's pages are gone from the mapping (a page or two at its ends stay
    # with the neighbouring tensors)
    assert _mapped_kib(path) < 64, _mapped_kib(path)
    want = gguf.quants.dequantize(gguf.quants.quantize(big, Q.Q4_0), Q.Q4_0)
    assert torch.equal(form.dequantized(), torch.from_numpy(want))
