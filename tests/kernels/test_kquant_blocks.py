"""A GGUF file's K-quant matrices (Q4_K, Q5_K, Q6_K) served in their own bytes
(runtime/loading/kquant_weights.py, kernels/cpu/block_ops.c): the C dequantization equals the
`gguf` package's bit for bit, the block kernel's products are those exact weights times x at
every step size (the row groups of small steps and the panels of larger ones, every tail of
rows and tokens, a bias, a strided input, one thread or two), and the fused decode layer runs
a K-quant model as the op-by-op path does; in the AVX-512 build and in the AVX2 one.

Blocks are random bytes with finite float16 scales: every byte pattern is a valid block, so
they reach every code, scale, min and sign the formats can hold (the `gguf` package has no
K-quant quantizers to draw "typical" blocks from).
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_build, cpu_ops
from kernels.cpu_layer import FusedDecoder
from runtime.loading.kquant_weights import (
    KQUANT_FORMS,
    KQuantWeight,
    Q4KWeight,
    Q5KWeight,
    Q6KWeight,
    StackedBlocks,
    kquant_weight,
)
from runtime.loading.quantization import Int4Weight
from testkit.q4_weights import q4_1_weight

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")

FORMS = [Q4KWeight, Q5KWeight, Q6KWeight]
ids = [f.ggml_type for f in FORMS]
# where each form keeps its float16 fields within a block: Q4_K/Q5_K open with d, dmin;
# Q6_K ends with d
HALVES = {Q4KWeight: (0, 2), Q5KWeight: (0, 2), Q6KWeight: (208,)}


def random_blocks(form: type[KQuantWeight], n: int, k: int, seed: int,
                  scale: float = 0.01) -> np.ndarray:
    """[n, k/256, bytes] random bytes whose float16 fields are finite: normal values of
    either sign around `scale`, with some zeros and subnormals among them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, form.block_bytes), dtype=np.uint8)
    for at in HALVES[form]:
        h = (rng.standard_normal((n, k // 256)) * scale).astype(np.float16)
        pick = rng.random((n, k // 256))
        h[pick < 0.05] = 0.0
        h[(pick >= 0.05) & (pick < 0.1)] = np.float16(3e-7)  # subnormal in float16
        blocks[..., at:at + 2] = h.view(np.uint8).reshape(n, k // 256, 2)
    return blocks


def file_weights(w: KQuantWeight) -> torch.Tensor:
    """The reference: gguf's own dequantization of the same bytes, float32 [N, K]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    n, k = w.shape
    ref = dequantize(w.qs.reshape(n, -1).numpy(), GGMLQuantizationType[w.ggml_type])
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).view(n, k)


def reordered_sum_bound(w: torch.Tensor, x: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """How far a float32 x @ w.T (+ bias) may lie from the exact value, whatever order its
    products are summed in: gamma_n = n u / (1 - n u) times the sum of the terms' magnitudes
    (Higham, Accuracy and Stability, 3.1), n = K products and the bias, u float32's unit
    roundoff. From the type and the sum's length alone, as testkit/tolerances.py sets its."""
    n = w.shape[1] + 1
    u = torch.finfo(torch.float32).eps / 2
    gamma = n * u / (1 - n * u)
    terms = x.double().abs() @ w.double().abs().T
    if bias is not None:
        terms = terms + bias.double().abs()
    return gamma * terms


def assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    err = (got.double() - exact).abs()
    bound = reordered_sum_bound(w, x, bias)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool((err <= bound).all()), \
        f"off by up to {float((err - bound).max()):.3g} past the bound"


@pytest.mark.parametrize("form", FORMS, ids=ids)
@pytest.mark.parametrize("n,k", [(1, 256), (37, 768), (70, 2048)], ids=str)
def test_dequantize_rows_equal_gguf_bit_for_bit(form, n, k):
    w = form(random_blocks(form, n, k, seed=n + k))
    got, ref = w.dequantized(), file_weights(w)
    assert got.shape == (n, k) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # zeros' signs too


@pytest.mark.parametrize("form", FORMS, ids=ids)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 33, 200])
@pytest.mark.parametrize("n,k", [(37, 768), (70, 2048)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_is_the_file_weights_times_x(form, rows, n, k, with_bias, threads):
    """37 and 70 rows leave groups of fewer than four rows and part-filled panels; 1-8 tokens
    run the row groups (every tile height), 9 to 200 the panels in every format (Q5_K/Q6_K
    from 11 tokens, Q4_K from 15 in the AVX-512 build) with token tiles of every height."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = form(random_blocks(form, n, k, seed=rows + n))
    ref = file_weights(w)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k + 9, generator=g)[:, 4:4 + k]  # a row stride wider than the row
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = w.matmul(x, bias)
    finally:
        torch.set_num_threads(before)
    assert_product(got, x, ref, bias)


@pytest.mark.parametrize("form", FORMS, ids=ids)
@pytest.mark.parametrize("rows", [4, 512])
def test_one_hot_inputs_give_every_weight_exactly(form, rows):
    """Token t = e_t: every output is one product w * 1 plus exact zeros, so the step returns
    the kernel's weights themselves, unrounded: 4 tokens through the row groups, 512 through
    the panels (every transposed block), each equal to gguf's to the bit; with a bias, one
    float32 addition."""
    n, k = 45, 512
    w = form(random_blocks(form, n, k, seed=rows))
    ref = file_weights(w)
    x = torch.eye(k)[:rows]
    got = w.matmul(x)
    assert torch.equal(got, ref[:, :rows].T)
    bias = torch.randn(n)
    assert torch.equal(w.matmul(x, bias), ref[:, :rows].T + bias)


def test_the_forms_read_a_gguf_tensor_in_place():
    """A GGUF reader's tensor (rows of raw bytes, a read-only memory map) is used as it is:
    no copy, so the matrix is resident once; the shape is checked."""
    form = Q6KWeight
    blocks = random_blocks(form, 12, 512, seed=1).reshape(12, -1)
    rows = np.frombuffer(blocks.tobytes(), dtype=np.uint8).reshape(12, -1)  # read-only
    assert not rows.flags.writeable
    w = kquant_weight("Q6_K", rows, shape=(12, 512))
    assert w.qs.shape == (12, 2, 210) and w.qs.data_ptr() == rows.ctypes.data
    assert w.shape == (12, 512) and w.exact and w.kind == "q6_k" and w.nbytes == 12 * 2 * 210
    assert torch.equal(w.dequantized(), file_weights(w))
    with pytest.raises(ValueError, match=r"not \(12, 768\)"):
        kquant_weight("Q6_K", rows, shape=(12, 768))
    with pytest.raises(ValueError, match="not whole 144-byte blocks"):
        Q4KWeight(rows)
    with pytest.raises(ValueError, match="uint8"):
        Q6KWeight(rows.view(np.int8))
    with pytest.raises(KeyError, match="Q3_K"):
        kquant_weight("Q3_K", rows)
    assert set(KQUANT_FORMS) == {"Q4_K", "Q5_K", "Q6_K"}


def test_rows_reordered_and_parts_stacked_keep_their_blocks():
    """`map_rows` (the loader's Q/K row interleave undone) and `cat` (fused q/k/v) move whole
    rows of blocks: the weights are the parts' own, reordered and stacked."""
    a, b = (Q4KWeight(random_blocks(Q4KWeight, n, 512, seed=n)) for n in (8, 5))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    moved = a.map_rows(lambda t: t[perm])
    assert torch.equal(moved.dequantized(), a.dequantized()[perm])
    both = Q4KWeight.cat([moved, b])
    assert both.shape == (13, 512)
    assert torch.equal(both.dequantized(), torch.cat([moved.dequantized(), b.dequantized()]))
    with pytest.raises(TypeError, match="Q4KWeight parts only"):
        Q4KWeight.cat([a, Q6KWeight(random_blocks(Q6KWeight, 2, 512, seed=2))])


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_parts_in_different_forms_multiply_into_their_own_columns(rows):
    """A fused q/k/v whose parts a file holds in Q4_K, Q6_K and Q4_1: each part's product in
    its columns of one output, with its slice of the bias."""
    parts = [Q4KWeight(random_blocks(Q4KWeight, 24, 512, seed=1)),
             Q6KWeight(random_blocks(Q6KWeight, 9, 512, seed=2)),
             Int4Weight(q4_1_weight(13, 512, seed=3))]
    w = StackedBlocks(parts)
    assert w.shape == (46, 512) and w.exact and w.kind == "q4_k+q6_k+int4"
    assert w.nbytes == sum(p.nbytes for p in parts)
    ref = torch.cat([file_weights(parts[0]), file_weights(parts[1]), parts[2].dequantized()])
    assert torch.equal(w.dequantized(), ref)
    x, bias = torch.randn(rows, 512), torch.randn(46)
    assert_product(w.matmul(x, bias), x, ref, bias)
    assert_product(w.matmul(x), x, ref, None)
    with pytest.raises(ValueError, match="one input size"):
        StackedBlocks([parts[0], Q4KWeight(random_blocks(Q4KWeight, 2, 256, seed=4))])


@pytest.mark.parametrize("form", FORMS, ids=ids)
def test_without_the_compiled_kernels_the_float_path_gives_the_same_weights(form, monkeypatch):
    """Where the C library is missing (or the activations are not float32 on the CPU) the
    weights come from gguf's dequantizer and the product from F.linear: the same weights."""
    w = form(random_blocks(form, 9, 512, seed=5))
    ref = file_weights(w)
    x, bias = torch.randn(6, 512), torch.randn(9)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    monkeypatch.setattr(kernels, "use_cpu_ops", lambda t: False)
    assert torch.equal(w.dequantized(), ref)
    torch.testing.assert_close(w.matmul(x, bias), F.linear(x, ref, bias), rtol=0, atol=0)
    bf = w.matmul(x.bfloat16())
    assert bf.dtype == torch.bfloat16 and bf.shape == (6, 9)


# ---- the fused decode layer (kernels/cpu/decode_layer.c) with K-quant projections ----

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, PAGE = 256, 4, 2, 64, 512, 4


def kquant_linear(form, n, k, seed):
    """What the fused decoder reads of a Linear: a K-quant weight and no float copy."""
    w = form(random_blocks(form, n, k, seed=seed, scale=2e-4))
    return SimpleNamespace(packed=None, small=w, max_small_rows=0, max_quant_rows=0, weight=None,
                           bias=None, shape=w.shape)


def stacked_linear(seed):
    """q and k in Q4_K, v in Q6_K (a Q4_K_M file's attention on some layers), with a bias."""
    qk = Q4KWeight(random_blocks(Q4KWeight, (HEADS + KV_HEADS) * HEAD_DIM, HIDDEN, seed=seed,
                                 scale=2e-4))
    v = Q6KWeight(random_blocks(Q6KWeight, KV_HEADS * HEAD_DIM, HIDDEN, seed=seed + 1,
                                scale=2e-4))
    w = StackedBlocks([qk, v])
    bias = 0.1 * torch.randn(w.shape[0], generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(packed=None, small=w, max_small_rows=0, max_quant_rows=0, weight=None,
                           bias=bias, shape=w.shape)


def kquant_layers(count: int, stacked: bool = False):
    g = torch.Generator().manual_seed(count)
    layers = []
    for i in range(count):
        nqkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        layers.append(SimpleNamespace(
            input_norm=1 + 0.1 * torch.randn(HIDDEN, generator=g),
            post_norm=1 + 0.1 * torch.randn(HIDDEN, generator=g),
            num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6,
            attn=SimpleNamespace(scale=HEAD_DIM ** -0.5),
            # Q4_K_M's mix: Q4_K mostly, Q6_K for the down projection; Q5_K for o_proj here
            qkv=stacked_linear(10 * i) if stacked else kquant_linear(Q4KWeight, nqkv, HIDDEN,
                                                                       10 * i),
            o_proj=kquant_linear(Q5KWeight, HIDDEN, HEADS * HEAD_DIM, 10 * i + 1),
            gate_up=kquant_linear(Q4KWeight, 2 * INTER, HIDDEN, 10 * i + 2),
            down=kquant_linear(Q6KWeight, HIDDEN, INTER, 10 * i + 3)))
    return layers


def decode_step(batch: int, layers: int, seed: int):
    """A decode-only step: each sequence's context (random K/V already cached) and the
    position of its new token, the caches' pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * PAGE, (batch,), generator=g)
    width = int((lens.max() + PAGE - 1) // PAGE)
    pages = torch.randperm(batch * width, generator=g).view(batch, width) + 1
    caches = [(torch.randn((batch * width + 1) * PAGE, KV_HEADS, HEAD_DIM, generator=g),
               torch.randn((batch * width + 1) * PAGE, KV_HEADS, HEAD_DIM, generator=g))
              for _ in range(layers)]
    pos = lens - 1
    slots = pages[torch.arange(batch), pos // PAGE] * PAGE + pos % PAGE
    cos, sin = kernels.rotary_cos_sin(pos, HEAD_DIM, 10000.0, torch.float32)
    meta = SimpleNamespace(num_chunks=0, num_decode=batch, cos=cos, sin=sin,
                           slot_mapping=slots, decode_tables=pages, decode_lens=lens,
                           block_size=PAGE)
    x = torch.randn(batch, HIDDEN, generator=g)
    return x, meta, caches


def op_by_op(layers, x, meta, caches):
    """The layers one op at a time (runtime/models/llama.py's DecoderLayer.forward), with
    each projection's own `matmul`."""
    residual = None
    for layer, (k_cache, v_cache) in zip(layers, caches):
        if residual is None:
            residual, h = x, cpu_ops.rms_norm(x, layer.input_norm, layer.eps)
        else:
            h, residual = cpu_ops.rms_norm(x, layer.input_norm, layer.eps, residual)
        t, nq, nk = h.shape[0], HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        qkv = layer.qkv.small.matmul(h, layer.qkv.bias)
        qk = cpu_ops.apply_rotary_(qkv[:, :nq + nk].view(t, -1, HEAD_DIM), meta.cos, meta.sin)
        q, k = qk[:, :HEADS], qk[:, HEADS:]
        v = qkv[:, nq + nk:].reshape(t, KV_HEADS, HEAD_DIM)
        cpu_ops.store_kv(k.contiguous(), v, k_cache, v_cache, meta.slot_mapping)
        attn = cpu_ops.decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_tables,
                                        meta.decode_lens, PAGE, layer.attn.scale)
        h = layer.o_proj.small.matmul(attn.reshape(t, nq))
        h, residual = cpu_ops.rms_norm(h, layer.post_norm, layer.eps, residual)
        x = layer.down.small.matmul(cpu_ops.silu_and_mul(layer.gate_up.small.matmul(h)))
    return x, residual


@pytest.mark.parametrize("batch", [1, 3, 9, 33])
@pytest.mark.parametrize("stacked", [False, True], ids=["one-form", "stacked-qkv"])
def test_the_fused_layer_runs_a_kquant_model_as_the_op_by_op_path(batch, stacked):
    """A Q4_K/Q5_K/Q6_K model without float copies: the C layer takes every decode-only
    step (the blocks serve any size: 1 and 3 sequences by the row groups, 33 by the panels),
    and its hidden states and residuals are the op-by-op ones; also with a q/k/v whose v
    rows are Q6_K (a chain of two matrices in C) and a bias."""
    layers = kquant_layers(2, stacked)
    fused = FusedDecoder.build(layers, torch.float32)
    assert fused is not None and fused.max_rows >= 1 << 20
    w = fused.weights[0]
    assert w.down.format == cpu_ops.BLOCK_Q6_K and not w.down.dense
    if stacked:
        assert w.qkv.n == (HEADS + KV_HEADS) * HEAD_DIM and w.qkv.next
        assert w.qkv.next.contents.format == cpu_ops.BLOCK_Q6_K
        assert w.qkv.next.contents.n == KV_HEADS * HEAD_DIM and not w.qkv.next.contents.next
    x, meta, caches = decode_step(batch, len(layers), seed=batch)
    assert fused.takes(meta, batch, caches)
    expected, expected_res = op_by_op(layers, x.clone(), meta,
                                      [(k.clone(), v.clone()) for k, v in caches])
    got, got_res = fused.forward(x.clone(), meta, caches)
    scale = float(expected.pow(2).mean().sqrt())
    torch.testing.assert_close(got_res, expected_res, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


AVX2_CHECK = """
import sys, torch
sys.path.insert(0, "tests/kernels")
from kernels import cpu_build, cpu_ops
import test_kquant_blocks as t
assert cpu_build.isa() == "avx2" and "-mavx512f" not in cpu_build.flags()
assert cpu_ops.available(), cpu_build.unavailable_reason()
for form in t.FORMS:
    for rows in (1, 3, 4, 8, 9, 12, 33, 70):
        w = form(t.random_blocks(form, 37, 768, seed=rows))
        ref = t.file_weights(w)
        assert torch.equal(w.dequantized().view(torch.int32), ref.view(torch.int32))
        x, bias = torch.randn(rows, 768), torch.randn(37)
        t.assert_product(w.matmul(x, bias), x, ref, bias)
    w = form(t.random_blocks(form, 20, 256, seed=7))
    assert torch.equal(w.matmul(torch.eye(256)), t.file_weights(w).T)
print("ok")
"""


@pytest.mark.skipif(cpu_build.isa() != "avx512", reason="this CPU builds only the AVX2 kernel")
def test_the_avx2_build_computes_the_same(tmp_path):
    """On an AVX-512 machine the tests above ran the 16-lane kernels; the 8-lane ones are
    checked here from the AVX2 library (the child asserts it loaded that one)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, INFERSTACK_CPU_ISA="avx2", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
