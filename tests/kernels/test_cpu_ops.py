"""The compiled CPU decode ops (kernels/cpu/decode_ops.c) against the torch references, on
shapes that reach every tile and tail of the C code: odd row counts, widths that are not a
multiple of the vector, strided inputs, grouped-query heads and pages cut mid-context."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_build, cpu_ops
from kernels.activation import silu_and_mul_ref
from kernels.paged_attention import context_slots, paged_decode_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotary_cos_sin
from runtime.loading.quantization import Int8Weight

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"no compiled CPU ops: {cpu_build.unavailable_reason()}")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("n,k", [(6, 20), (13, 40), (64, 64), (576, 1536)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_int8_linear_equals_the_float_matmul_of_its_dequantized_weight(rows, n, k, with_bias):
    g = gen(rows * 1000 + n)
    packed = Int8Weight(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g) if with_bias else None
    wide = torch.randn(rows, k + 5, generator=g)
    x = wide[:, 3:3 + k]  # a row stride wider than the row
    got = cpu_ops.int8_linear(x, packed.q, packed.scale, bias)
    expected = F.linear(x, packed.dequantized(), bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13, 32, 33, 64])
@pytest.mark.parametrize("n,k", [(6, 20), (40, 33), (576, 576)], ids=str)
def test_int8_linear_from_panels_equals_the_row_kernel(rows, n, k):
    """The panel layout (16 rows input-major, the last panel zero-padded) gives the same
    products as the row kernel, with a bias, for any row count (balanced tile heights)."""
    g = gen(rows * 7 + n)
    packed = Int8Weight(torch.randn(n, k, generator=g))
    assert packed.panels.shape == ((n + 15) // 16, k, 16)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    got = cpu_ops.int8_linear_panels(x, packed.panels, packed.scale, bias)
    torch.testing.assert_close(got, F.linear(x, packed.dequantized(), bias), rtol=1e-5,
                               atol=1e-4)
    torch.testing.assert_close(got, cpu_ops.int8_linear(x, packed.q, packed.scale, bias),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 576), (17, 100), (3, 5)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_the_reference(shape, with_residual):
    g = gen(1)
    x = 3 * torch.randn(shape, generator=g)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    residual = torch.randn(shape, generator=g) if with_residual else None
    x0 = x.clone()
    got = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x0)  # inputs are never written


@pytest.mark.parametrize("shape", [(1, 3072), (9, 40), (2, 3, 22)], ids=str)
def test_silu_and_mul_matches_the_reference(shape):
    gate_up = 6 * torch.randn(shape, generator=gen(2))
    got = cpu_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(got, silu_and_mul_ref(gate_up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [12, 16, 64])
def test_rotary_rotates_a_strided_view_in_place(head_dim):
    heads, kv_heads, t = 4, 2, 5
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=gen(3))
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(t, -1, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cos, sin = rotary_cos_sin(torch.tensor([0, 1, 7, 300, 2047]), head_dim, 10000.0,
                              torch.float32)
    expected = apply_rotary_ref(qk.clone(), cos, sin)
    out = cpu_ops.apply_rotary_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # V untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_writes_only_the_given_slots_from_views_of_different_strides(cache_dtype):
    g = gen(4)
    kc, vc = torch.zeros(40, 2, 20, dtype=cache_dtype), torch.zeros(40, 2, 20, dtype=cache_dtype)
    qkv = torch.randn(4, 4 * 20 + 2 * 20, generator=g) * 300  # float16 rounds at this size
    qkv[0, 40] = 1e6  # past float16's range: inf, as torch's cast makes it
    qkv[0, 41] = float("nan")
    key = qkv[:, 40:80].view(4, 2, 20)
    value = torch.randn(4, 2, 20, generator=g)  # contiguous: another row stride
    slots = torch.tensor([5, 39, -1, 0])  # a negative slot stores nothing
    cpu_ops.store_kv(key, value, kc, vc, slots)
    keep = slots >= 0
    # rounded to nearest even, bit for bit what torch's cast gives
    for cache, new in ((kc, key), (vc, value)):
        torch.testing.assert_close(cache[slots[keep]], new[keep].to(cache_dtype), atol=0,
                                   rtol=0, equal_nan=True)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not kc[untouched].any() and not vc[untouched].any()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 16), (9, 3, 64), (4, 4, 12)],
                         ids=str)
@pytest.mark.parametrize("page", [4, 16])
def test_decode_attention_matches_the_reference(heads, kv_heads, head_dim, page):
    g = gen(5)
    lens = torch.tensor([1, 5, page, page + 1, 100])
    width = (int(lens.max()) + page - 1) // page
    num_blocks = len(lens) * width + 3
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    kc = torch.randn(num_blocks * page, kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks * page, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    slots, valid = context_slots(tables, lens, page)
    expected = paged_decode_attention_ref(q, kc, vc, slots, valid, scale)
    out = torch.full_like(q, float("nan"))
    got = cpu_ops.decode_attention(q, kc, vc, tables, lens, page, scale, out=out)
    assert got is out
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)


def test_no_compiler_means_no_library_and_a_reason(monkeypatch):
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    assert cpu_build.load() is None
    assert "no C compiler" in cpu_build.unavailable_reason()


def test_a_source_that_does_not_compile_is_reported_not_loaded(monkeypatch, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in cpu_build.SOURCES:
        (src / name).write_text("this is not C;\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", src)
    monkeypatch.setattr(cpu_build, "_state", {})
    assert cpu_build.load() is None
    assert "failed" in cpu_build.unavailable_reason()
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind


def test_the_library_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_build._build(cpu_build.compiler())
    assert first.exists() and cpu_build._build(cpu_build.compiler()) == first
