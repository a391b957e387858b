"""The block kernel (kernels/cpu/block_ops.c) and its weight formats (Int4Weight,
Int8BlockWeight): a GGUF Q4_1, Q4_0 or Q8_0 matrix is held exactly, and the kernel multiplies
by exactly those weights, in its
AVX-512 build and in its AVX2 one, over every tile and tail (rows not a multiple of four,
tokens not a multiple of four, one block or many, a bias, a strided input); and the float
GEMM (kernels/cpu/f32_ops.c) that runs the same weights' larger steps."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_build, cpu_ops
from runtime.loading.quantization import Int4Weight, Int8BlockWeight, QuantizationError
from testkit.q4_weights import q4_1_weight

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")


def test_a_q4_1_matrix_is_held_exactly():
    w = q4_1_weight(48, 96, seed=3)
    p = Int4Weight(w)
    assert p.exact and p.qs.shape == (48, 3, 16) and p.d.dtype == torch.float16
    assert torch.equal(p.dequantized(), w)  # the file's own weights, bit for bit
    assert p.nbytes == 48 * 96 // 2 + 2 * 2 * 48 * 3  # 5 bits a weight, as in the file


def test_weights_four_bits_cannot_hold_are_marked_inexact():
    w = torch.randn(16, 64)
    p = Int4Weight(w)
    assert not p.exact
    # still the nearest 4-bit values of each block: within half a step (plus d's float16
    # rounding, up to 2^-11 relative, times q <= 15)
    err = (p.dequantized() - w).view(16, 2, 32).abs().amax(-1)
    d = p.d.float()
    assert bool((err <= d * (0.5 + 15 * 2 ** -10) + 1e-6).all())


def test_input_sizes_not_in_blocks_are_refused():
    with pytest.raises(QuantizationError, match="divisible by 32"):
        Int4Weight(torch.randn(8, 40))


# from 9 rows up the weight is dequantized in panels of 32 rows (fewer where K is wide: 8 at
# 8192); n = 70 and 37 leave short panels and groups of fewer than four rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 37])
@pytest.mark.parametrize("n,k", [(5, 32), (13, 64), (64, 96), (70, 576), (576, 1536),
                                 (37, 8192)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_int4_linear_multiplies_by_the_dequantized_weight(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 100 + n)
    p = Int4Weight(q4_1_weight(n, k, seed=rows + n))
    bias = torch.randn(n, generator=g) if with_bias else None
    wide = torch.randn(rows, k + 7, generator=g)
    x = wide[:, 5:5 + k]  # a row stride wider than the row
    got = cpu_ops.block_linear(x, p.qs, 4, p.d, p.m, bias)
    tol = 1e-5 if k <= 1536 else 1e-4  # 8192 products summed in another order round further
    torch.testing.assert_close(got, F.linear(x, p.dequantized(), bias), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 37])
@pytest.mark.parametrize("n,k", [(5, 32), (13, 64), (576, 1536)], ids=str)
def test_8bit_blocks_multiply_by_their_dequantized_weight(rows, n, k):
    g = torch.Generator().manual_seed(rows + n)
    p = Int8BlockWeight(torch.randn(n, k, generator=g))
    assert p.qs.shape == (n, k // 32, 32) and p.nbytes == n * k + 2 * n * (k // 32)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k + 2, generator=g)[:, 1:1 + k]
    torch.testing.assert_close(cpu_ops.block_linear(x, p.qs, 8, p.d, None, bias),
                               F.linear(x, p.dequantized(), bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 33, 64])
@pytest.mark.parametrize("n,k", [(5, 20), (13, 64), (70, 100), (576, 1536)], ids=str)
def test_f32_linear_equals_torch(rows, n, k):
    g = torch.Generator().manual_seed(rows * 10 + n)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, k + 3, generator=g)[:, 1:1 + k]
    torch.testing.assert_close(cpu_ops.f32_linear(x, w, bias), F.linear(x, w, bias),
                               rtol=1e-4, atol=1e-4)


AVX2_CHECK = """
import torch, torch.nn.functional as F
from kernels import cpu_build, cpu_ops
from runtime.loading.quantization import Int4Weight, Int8BlockWeight
from testkit.q4_weights import q4_1_weight
assert cpu_build.isa() == "avx2" and "-mavx512f" not in cpu_build.flags()
assert cpu_ops.available(), cpu_build.unavailable_reason()
assert cpu_build.load()._name.endswith(cpu_build.library_name(cpu_build.source_key()))
for rows in (1, 3, 4, 6, 9, 13):
    for n, k in ((5, 32), (13, 64), (70, 576)):
        p = Int4Weight(q4_1_weight(n, k, seed=rows))
        x = torch.randn(rows, k)
        torch.testing.assert_close(cpu_ops.block_linear(x, p.qs, 4, p.d, p.m, None),
                                   F.linear(x, p.dequantized()), rtol=1e-5, atol=1e-5)
        p8 = Int8BlockWeight(torch.randn(n, k))
        torch.testing.assert_close(cpu_ops.block_linear(x, p8.qs, 8, p8.d, None, None),
                                   F.linear(x, p8.dequantized()), rtol=1e-5, atol=1e-4)
        w, x = torch.randn(n, k + 3)[:, :k].contiguous(), torch.randn(rows * 3, k)
        torch.testing.assert_close(cpu_ops.f32_linear(x, w), F.linear(x, w), rtol=1e-4,
                                   atol=1e-4)
print("ok")
"""


@pytest.mark.skipif(cpu_build.isa() != "avx512", reason="this CPU builds only the AVX2 kernel")
def test_the_avx2_build_computes_the_same(tmp_path):
    """On an AVX-512 machine the tests above ran the 16-lane kernel; machines without it run
    the 8-lane one, checked here from the AVX2 library (the child asserts it loaded that one)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, INFERSTACK_CPU_ISA="avx2", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("kind,form", [("Q4_0", Int4Weight), ("Q4_1", Int4Weight),
                                       ("Q8_0", Int8BlockWeight)])
def test_gguf_quantizers_output_is_held_exactly(kind, form):
    """What the gguf package's own quantizers write (llama.cpp's reference algorithms), read
    back as the loader does, is held exactly: Q4_1 from each block's range, Q4_0 from its
    largest weight, Q8_0 from its largest |w| at 127."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(7)).numpy()
    t = GGMLQuantizationType[kind]
    file_weights = torch.from_numpy(dequantize(quantize(w, t), t).copy())
    p = form(file_weights)
    assert p.exact and torch.equal(p.dequantized(), file_weights)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(p.matmul(x), F.linear(x, file_weights), rtol=1e-5, atol=1e-5)
