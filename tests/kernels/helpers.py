"""Tolerances and poisoning shared by the kernel tests."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16]

# dtype -> (atol, rtol) of a kernel against its reference, for elementwise ops (norm, rotary,
# activation: one rounding apart) and for attention (a different summation order, and the
# softmax weights rounded to the input dtype before the P @ V product).
TOLERANCE = {
    "elementwise": {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3),
                    torch.bfloat16: (1.6e-2, 1.6e-2)},
    "attention": {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3),
                  torch.bfloat16: (2e-2, 2e-2)},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str) -> None:
    """Every element finite (a NaN means it was never written) and within the tolerance."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not torch.isnan(actual).any(), f"{int(torch.isnan(actual).sum())} elements unwritten"
    atol, rtol = TOLERANCE[kind][expected.dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), atol=atol, rtol=rtol)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel skips cannot pass."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def paged_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype,
                device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [num_blocks * block_size, KVH, D] full of NaN except block 0, which is
    finite (the references read slot 0 for padding and mask it out)."""
    shape = (num_blocks * block_size, kv_heads, head_dim)
    caches = []
    for _ in range(2):
        c = torch.full(shape, float("nan"), dtype=dtype)
        c[:block_size] = torch.randn(block_size, kv_heads, head_dim, generator=gen).to(dtype)
        caches.append(c.to(device))
    return caches[0], caches[1]


def fill_context(cache: torch.Tensor, table: torch.Tensor, length: int, block_size: int,
                 gen: torch.Generator) -> None:
    """Random K or V in the first `length` positions of one sequence's pages; the slots after
    it in its last page stay NaN."""
    pos = torch.arange(length)
    slots = table[pos // block_size].long().cpu() * block_size + pos % block_size
    values = torch.randn(length, *cache.shape[1:], generator=gen).to(cache.dtype)
    cache[slots.to(cache.device)] = values.to(cache.device)


def block_tables_for(lengths: list[int], block_size: int, gen: torch.Generator,
                     extra_blocks: int = 3) -> tuple[torch.Tensor, int]:
    """Shuffled page ids (never block 0) for sequences of the given lengths, rows padded with
    block 0. Returns (block_tables [B, W] int32, num_blocks)."""
    need = [-(-n // block_size) for n in lengths]
    width = max(max(need), 1)
    num_blocks = 1 + sum(need) + extra_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    rows = []
    for n in need:
        row, ids = ids[:n], ids[n:]
        rows.append(row + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.int32), num_blocks
