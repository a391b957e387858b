"""GGUF Q4_0/Q4_1/Q8_0 matrices read straight into the served block forms: the same values as
gguf's dequantizers, the same blocks as re-deriving them from those floats (today's path for
float checkpoints), and a model built either way gives the same logits."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kernels
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
from runtime.loading.gguf import open_gguf, read_gguf
from runtime.loading.gguf_blocks import read_blocks
from runtime.loading.loader import default_model_path, load_checkpoint
from runtime.loading.quantization import Int4Weight, Int8BlockWeight
from runtime.models.weights import LinearMaker
from testkit.tiny_gguf import llama_writer
from testkit.tolerances import read_from
from tests.runtime.test_gguf_loader import byte_level_vocab, permute_like_llama_cpp

C_KERNELS = pytest.mark.skipif(not kernels.cpu_ops_take(torch.float32),
                               reason="the block forms are served by the compiled CPU kernels")
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
MATRICES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
            "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# the shipped file's types (every matrix Q4_1, the embeddings Q8_0), and a mix: q/k/v all
# 4-bit but Q4_0 and Q4_1 (one form, stacked), gate/up 8- and 4-bit (two forms: float path)
ALL_Q4_1 = dict.fromkeys(MATRICES, Q.Q4_1)
MIXED = {**ALL_Q4_1, "attn_k": Q.Q4_0, "ffn_gate": Q.Q8_0, "ffn_down": Q.Q4_0}


def _matrix(rng, shape, kind) -> np.ndarray:
    w = rng.standard_normal(shape, np.float32) * 0.1
    w[0, :32] = 0  # an all-zero block
    return quantize(w, kind)


def write_gguf(path: str, types: dict, embed=Q.Q8_0, seed: int = 0) -> None:
    """A 2-layer llama GGUF whose matrices have the given types (Q/K rows permuted as
    llama.cpp's converter leaves them)."""
    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocab()
    writer = llama_writer(path, (tokens, merges), layers=LAYERS, hidden=HIDDEN, ffn=FFN,
                          heads=HEADS, kv_heads=KV_HEADS)
    writer.add_tensor("token_embd.weight", _matrix(rng, (len(tokens), HIDDEN), embed),
                      raw_dtype=embed)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", 1 + rng.random(HIDDEN, np.float32) / 4)
        for name, shape in MATRICES.items():
            w = rng.standard_normal(shape, np.float32) * 0.1
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            w = permute_like_llama_cpp(w, heads) if heads else w
            writer.add_tensor(f"blk.{i}.{name}.weight", quantize(w, types[name]),
                              raw_dtype=types[name])
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("blocks") / "mixed.gguf")
    write_gguf(path, MIXED)
    return path


# ---- the blocks -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_hold_the_files_values(kind):
    w = _matrix(np.random.default_rng(1), (64, 128), kind)
    want = torch.from_numpy(dequantize(w, kind))
    blocks = read_blocks(w.tobytes(), 0, (64, 128), int(kind))
    assert blocks is not None and blocks.exact and blocks.shape == (64, 128)
    assert torch.equal(blocks.dequantized(), want)  # gguf's float32 values, bit for bit


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_are_those_rederived_from_the_floats(kind):
    """What `Int4Weight` / `Int8BlockWeight` recover from the dequantized matrix (the path
    before the blocks were read directly): the same arrays for Q4_1 and Q8_0. A Q4_0 block
    that also fits the min..max form (it uses both codes 0 and 15) may come back in that
    form instead (d and m of the other sign), and an all-zero block (d = 0) holds any codes;
    their values are the same."""
    w = _matrix(np.random.default_rng(2), (64, 256), kind)
    blocks = read_blocks(w.tobytes(), 0, (64, 256), int(kind))
    assert blocks is not None
    form = Int8BlockWeight if kind == Q.Q8_0 else Int4Weight
    assert type(blocks) is form
    rederived = form(torch.from_numpy(dequantize(w, kind)))
    assert rederived.exact and torch.equal(rederived.dequantized(), blocks.dequantized())
    if kind != Q.Q4_0:
        assert all(torch.equal(a, b) for a, b in zip(blocks.arrays(), rederived.arrays()))
        return
    same = (blocks.d == rederived.d) & (blocks.d != 0)
    assert bool(same.float().mean() > 0.9)  # the file's own form, but for a few
    assert torch.equal(blocks.qs[same], rederived.qs[same])
    assert torch.equal(blocks.m[same], rederived.m[same])


def test_a_q4_0_scale_past_float16_range_is_left_to_the_float_path():
    block = np.zeros(1, [("d", "<f2"), ("qs", "u1", (16,))])
    block["d"] = 10000.0  # m = -8 d = -80000: no float16 holds it
    assert read_blocks(np.tile(block, 4).tobytes(), 0, (2, 64), int(Q.Q4_0)) is None


def test_other_types_have_no_block_form():
    f16 = np.zeros((4, 64), np.float16)
    assert read_blocks(f16.tobytes(), 0, (4, 64), int(Q.F16)) is None
    assert read_blocks(b"\0" * 72, 0, (128,), int(Q.Q4_0)) is None  # a vector


def test_q_and_k_rows_are_unpermuted_in_block_form(mixed):
    """llama.cpp's Q/K interleave, undone on the blocks' rows: the same matrices as the float
    reader's (which undoes it on floats)."""
    _, floats, _ = read_gguf(mixed)
    _, weights, _ = open_gguf(mixed)
    for proj in ("q", "k"):
        name = f"model.layers.1.self_attn.{proj}_proj.weight"
        blocks = weights.blocks(name)
        assert blocks is not None and torch.equal(blocks.dequantized(), floats[name])


def test_blocks_stack_along_n():
    parts = [read_blocks(_matrix(np.random.default_rng(s), (n, 64), Q.Q4_1).tobytes(), 0,
                         (n, 64), int(Q.Q4_1)) for s, n in ((3, 32), (4, 16))]
    stacked = Int4Weight.cat(parts)
    assert stacked.shape == (48, 64) and stacked.exact
    assert torch.equal(stacked.dequantized(),
                       torch.cat([p.dequantized() for p in parts]))  # type: ignore[union-attr]


# ---- the model ---------------------------------------------------------------------------------
def _engines(path: str, float_quantization: str | None = None, **config):
    """One engine on the file's blocks, one on its floats (the path before; quantized as
    `float_quantization` where given, else as the first)."""
    checkpoint = load_checkpoint(path)
    floats = dataclasses.replace(checkpoint, weights=dict(checkpoint.weights.items()))
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       **config)
    float_cfg = cfg if float_quantization is None \
        else dataclasses.replace(cfg, quantization=float_quantization)
    return LLMEngine(checkpoint, cfg), LLMEngine(floats, float_cfg)


@C_KERNELS
@pytest.mark.parametrize("types", [ALL_Q4_1, MIXED], ids=["q4_1", "mixed"])
def test_a_model_on_the_files_blocks_gives_the_same_logits(tmp_path, types):
    """The file's blocks, served alone at every step size (small steps in registers, large
    ones through the kernel's panels): the same blocks as re-derived from the floats for the
    shipped file's types, identical logits; for the mix (gate/up of Q8_0 and Q4_1 parts,
    stacked in their own forms) the logits of the file's float weights within float32's
    reordering of the sums."""
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, types)
    direct, rederived = _engines(path, None if types is ALL_Q4_1 else "none",
                                 quantization="int4")
    for a in direct.runner.model.linears():
        assert a.small is not None and a.dense is None  # resident once: no float copy
    if types is ALL_Q4_1:
        for a, b in zip(direct.runner.model.linears(), rederived.runner.model.linears()):
            assert all(torch.equal(x, y) for x, y in zip(a.small.arrays(), b.small.arrays()))
    prompt = list(range(3, 40))
    for length in (5, len(prompt)):  # one step of 5 rows (registers), one of 37 (panels)
        got, want = direct.prompt_logits(prompt[:length]), rederived.prompt_logits(prompt[:length])
        if types is ALL_Q4_1:
            assert torch.equal(got, want)
        else:  # float32 sums in another order, and the float16 KV cache may store one unit
            # apart
            scale = float(want.pow(2).mean().sqrt())
            torch.testing.assert_close(got, want, **read_from(torch.float16, scale))
    if types is ALL_Q4_1:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert direct.generate([prompt[:6]], params) == rederived.generate([prompt[:6]], params)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_other_formats_take_the_same_floats(mixed, quantization):
    direct, rederived = _engines(mixed, quantization=quantization)
    for a, b in zip(direct.runner.model.linears(), rederived.runner.model.linears()):
        assert torch.equal(a.weight, b.weight) and a.small is None
    prompt = list(range(3, 20))
    assert torch.equal(direct.prompt_logits(prompt), rederived.prompt_logits(prompt))


def test_the_float_path_where_the_block_kernels_do_not_run(mixed):
    """Without the compiled kernels (or off the CPU), blocks become floats as before."""
    _, weights, _ = open_gguf(mixed)
    maker = LinearMaker("int4", torch.float32, None, 8, torch.device("meta"))
    name = "model.layers.0.self_attn.o_proj.weight"
    blocks = weights.blocks(name)
    assert blocks is not None and maker._file_blocks([blocks]) is None


# ---- the shipped model -------------------------------------------------------------------------
@pytest.mark.model
@C_KERNELS
def test_smollm_blocks_are_the_ones_rederived_from_its_floats():
    """Every matrix of the shipped Q4_1 file, fused as the model fuses them: the blocks read
    from the file are those the float round trip recovered, array for array."""
    _, weights, _ = open_gguf(default_model_path())
    maker = LinearMaker("int4", torch.float32, None, 1)
    for i in (0, 17, 29):
        a = f"model.layers.{i}.self_attn."
        names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        direct = maker._file_blocks([weights.blocks(n) for n in names])
        rederived = maker._exact_blocks(torch.cat([weights[n] for n in names]))
        assert direct is not None and rederived is not None and type(direct) is type(rederived)
        assert all(torch.equal(x, y) for x, y in zip(direct.arrays(), rederived.arrays()))
    embed = weights.blocks("model.embed_tokens.weight")
    assert isinstance(embed, Int8BlockWeight)
    rederived = Int8BlockWeight(weights["model.embed_tokens.weight"])
    assert rederived.exact
    assert all(torch.equal(x, y) for x, y in zip(embed.arrays(), rederived.arrays()))


def test_membership_reads_no_tensor(mixed, monkeypatch):
    _, weights, _ = open_gguf(mixed)
    monkeypatch.setattr(type(weights), "blocks", lambda *a: pytest.fail("read a tensor"))
    assert "model.norm.weight" in weights and "lm_head.weight" not in weights
