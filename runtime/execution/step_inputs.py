"""A step's inputs as a few flat tensors, packed once on the host and moved in one copy.

The scheduled requests are laid out as [decodes (one token each) | prefill and extend chunks]
in one int64 buffer, T tokens, S sequences, block tables W pages wide:

    input_ids [T] | positions [T] | slot_mapping [T] | context_lens [S] | query_start [S + 1]
    | num_prefix [S] | block_tables [S, W] | sample_rows [N]

`sample_rows` are the rows whose logits are sampled (the last token of each request that
samples without proposals, in batch order): on the device with the rest, so the runner picks
them without a copy of its own, which would wait for the forward to finish.

Everything is computed from plain ints on the host (no device op, no sync) into one Python
list, turned into int64 in one C-speed conversion; on CUDA it goes through pinned memory in
one non-blocking copy (torch's pinned-memory cache keeps the block until that copy has run),
on the CPU the views are the host buffer itself. Table rows are padded to a bucketed width
(`table_width`) so shapes repeat from step to step.

Padding rows (a CUDA-graph bucket larger than the batch) are decodes of token 0 at position
0 whose K/V is stored in the padding page, which no request owns
(runtime/kv/block_pool.py: `padding_block_id`), with context length 1 and a table row holding
only that page: they read back the slot they just wrote, and their outputs are sliced off.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from runtime.scheduling.output import ScheduledRequest


@dataclass(frozen=True)
class StepLayout:
    """The host's facts about a packed step (plain ints: nothing here needs the device)."""

    num_tokens: int  # T, padding rows included
    num_seqs: int  # S, padding rows included
    num_decode: int  # the leading sequences of one token each (padding rows are decodes)
    width: int  # W, pages per block-table row
    max_decode_context: int  # the longest context among the decodes (0 without any)
    max_query: int  # the longest chunk among the other sequences (0 without any)
    num_samples: int = 0  # N: rows sampled after the forward

    @property
    def model_size(self) -> int:
        """Values the forward reads (all but sample_rows): what a CUDA graph captures."""
        return 3 * self.num_tokens + 3 * self.num_seqs + 1 + self.num_seqs * self.width

    @property
    def size(self) -> int:
        return self.model_size + self.num_samples


@dataclass
class StepTensors:
    """Views of one packed buffer (see the module docstring for the layout)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token's K/V
    context_lens: torch.Tensor  # [S] tokens of each sequence's context after this step
    query_start: torch.Tensor  # [S + 1] first row of each sequence, then T
    num_prefix: torch.Tensor  # [S] tokens of each sequence already in the cache
    block_tables: torch.Tensor  # [S, W] page ids (padding: page 0, never read)
    sample_rows: torch.Tensor  # [N] rows whose logits are sampled


@dataclass
class HostStep:
    """A packed step on the host: the values, their layout and, per request id, the row of
    its last token (proposals included)."""

    values: torch.Tensor  # [layout.size] int64, CPU
    layout: StepLayout
    last_index: dict[str, int]


TABLE_WIDTH_STEP = 16  # pages: 256 tokens of context at the default block size


def table_width(num_pages: int) -> int:
    """Block-table width for a step whose longest row has `num_pages` pages, rounded up to a
    multiple of TABLE_WIDTH_STEP: shapes repeat from step to step and the row stride keeps its
    alignment (what Triton specializes on), while a power of two would pack up to twice the
    pages (a graph bucket uses its own fixed width)."""
    return max(1, -(-num_pages // TABLE_WIDTH_STEP)) * TABLE_WIDTH_STEP


def views(flat: torch.Tensor, layout: StepLayout) -> StepTensors:
    t, s, w = layout.num_tokens, layout.num_seqs, layout.width
    ids, pos, slots, lens, starts, prefix, tables, samples = torch.split(
        flat[:layout.size], [t, t, t, s, s + 1, s, s * w, layout.num_samples])
    return StepTensors(ids, pos, slots, lens, starts, prefix, tables.view(s, w), samples)


def _chunk_slots(table: tuple[int, ...], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1: one range per page, not a Python op per token."""
    slots: list[int] = []
    pos = start
    while pos < end:
        page = pos // block_size
        stop = min(end, (page + 1) * block_size)
        base = (table[page] - page) * block_size  # slot = table[page] * bs + pos % bs
        slots.extend(range(base + pos, base + stop))
        pos = stop
    return slots


def pack(batch: Sequence[ScheduledRequest], block_size: int, *, rows: int | None = None,
         width: int | None = None, pad_block: int | None = None) -> HostStep:
    """The step's inputs on the host. `rows` pads a batch of decodes with padding rows up to
    a CUDA-graph bucket (needs `pad_block`); `width` fixes the table width (at least the
    longest row), else it is bucketed by `table_width`."""
    decodes = [s for s in batch if s.num_new_tokens == 1]
    chunks = [s for s in batch if s.num_new_tokens > 1]
    bs = block_size
    # decodes: plain ints per request, no tensor op
    starts = [s.start_position for s in decodes]
    ids = [s.token_ids[0] for s in decodes]
    slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, starts)]
    positions = list(starts)
    lens = [p + 1 for p in starts]
    last_index = {s.request_id: i for i, s in enumerate(decodes)}
    query_start = list(range(len(decodes) + 1))
    # prefill and extend chunks (a speculating request's proposals run as a chunk too)
    row = len(decodes)
    max_query = 0
    for s in chunks:
        start, n = s.start_position, s.num_new_tokens
        ids.extend(s.token_ids)
        ids.extend(s.spec_token_ids)
        positions.extend(range(start, start + n))
        slots.extend(_chunk_slots(s.block_ids, start, start + n, bs))
        starts.append(start)
        lens.append(start + n)
        row += n
        query_start.append(row)
        last_index[s.request_id] = row - 1
        max_query = max(max_query, n)
    ordered = decodes + chunks
    pages = [len(s.block_ids) for s in ordered]
    num_pad = 0
    if rows is not None:
        if chunks or rows < len(decodes) or pad_block is None:
            raise ValueError(f"padding to {rows} rows needs at most {rows} decodes, no "
                             f"chunks and a padding page")
        num_pad = rows - len(decodes)
        ids += [0] * num_pad
        positions += [0] * num_pad
        slots += [pad_block * bs] * num_pad
        lens += [1] * num_pad
        starts += [0] * num_pad
        query_start += range(row + 1, row + num_pad + 1)
    w = table_width(max(pages, default=1))
    if width is not None:
        if width < max(pages, default=0):
            raise ValueError(f"block-table width {width} < the longest row ({max(pages)})")
        w = width
    zeros = [0] * w
    tables = list(chain.from_iterable(
        chain(s.block_ids, zeros[:w - n]) for s, n in zip(ordered, pages)))
    if num_pad:
        tables += ([pad_block] + zeros[1:]) * num_pad
    samples = [last_index[s.request_id] for s in batch if s.samples and not s.num_spec]
    layout = StepLayout(len(ids), len(ordered) + num_pad, len(decodes) + num_pad, w,
                        max(lens[:len(decodes) + num_pad], default=0), max_query, len(samples))
    values = array("q", ids)
    for part in (positions, slots, lens, query_start, starts, tables, samples):
        values.fromlist(part)
    return HostStep(torch.frombuffer(values, dtype=torch.int64), layout, last_index)


def to_device(values: torch.Tensor, device: torch.device,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed values on `device` (into the front of `out` when given: a CUDA graph's
    static buffer). One non-blocking copy through pinned memory on CUDA."""
    if device.type == "cpu":
        return values if out is None else out[:values.numel()].copy_(values)
    pinned = values.pin_memory()
    if out is None:
        return pinned.to(device, non_blocking=True)
    return out[:values.numel()].copy_(pinned, non_blocking=True)
