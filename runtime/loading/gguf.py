"""Read a GGUF file: model config, weights under Hugging Face names, tokenizer.

The header (metadata, tokenizer, tensor directory) is parsed from the mapped file; the tensors
are read when the model asks for them (`GGUFWeights`): quantized matrices (Q4_0, Q4_1, Q5_0,
Q8_0, the K-quants, IQ4_NL exactly; Q5_1, Q2_K, Q3_K, IQ4_XS approximately, the error
reported) straight into the block forms the CPU kernels serve (runtime/loading/gguf_blocks.py),
anything else dequantized to float32 by gguf's own dequantizers. Mixtures of experts'
stacked expert tensors are split per expert here (runtime/loading/gguf_arch.py names them).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from contract.config import ModelConfig
from contract.errors import ModelLoadError
from contract.tokenizer import Tokenizer
from runtime.loading.gguf_arch import (  # noqa: F401 - the names callers know from here
    ARCHITECTURES,
    PERMUTED_ARCHITECTURES,
    config_from_metadata,
    expert_names,
    hf_name,
    kv_b_half,
)
from runtime.loading.gguf_header import TensorInfo, errors_named, read_header
from runtime.loading.rope_rows import (
    latent_rows_in_halves,
    query_rows_in_halves,
    undo_llama_cpp_interleave,
)

if TYPE_CHECKING:  # the block forms import the kernels; a tokenizer-only read needs neither
    from runtime.loading.quantization import BlockWeight



def open_gguf(path: str) -> tuple[ModelConfig, GGUFWeights, Tokenizer]:
    """Config, weights (read from the mapped file when asked, see `GGUFWeights`) and tokenizer
    of a GGUF file. Reads the header only: no tensor data yet."""
    meta, tensors = read_header(path)
    with errors_named(path):
        by_name = {t.name: t for t in tensors}
        config = config_from_metadata(meta, by_name, _rope_factors(path, by_name))
        tokenizer = Tokenizer.from_gguf_metadata(_tokenizer_metadata(meta))
        weights = GGUFWeights(path, tensors, config, meta.get("general.architecture"))
    return config, weights, tokenizer


def _rope_factors(path: str, tensors: dict) -> tuple[float, ...]:
    """The `rope_freqs.weight` tensor's values (Llama 3.1's files), () where there is none."""
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return ()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return tuple(float(v) for v in _dequantize(mm, info, path).reshape(-1).tolist())


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, dequantized float32 weights (HF names and layout) and tokenizer of a GGUF file."""
    config, weights, tokenizer = open_gguf(path)
    return config, dict(weights.items()), tokenizer


def read_gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads the header, not the weights)."""
    meta, _ = read_header(path)
    with errors_named(path):
        return Tokenizer.from_gguf_metadata(_tokenizer_metadata(meta))


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by Hugging Face name, read from the mapped file when asked and
    not kept (a stack of experts, [E, N, K], as one [N, K] matrix per expert, each read from
    its own byte range of the stack; DeepSeek's split attn_k_b / attn_v_b as the kv_b_proj
    they were split from, a float): `weights[name]` is float32 in HF layout (what `read_gguf`
    returns: gguf's dequantization, exactly), and `blocks(name)` a quantized matrix in its
    served block form (runtime/loading/gguf_blocks.py), None for float types. Both undo
    llama.cpp's Q/K row interleave (and put DeepSeek's rotated rows in halves). A type served
    approximately has its error on the form (`error`). The model takes each tensor once, in
    the form it serves, so nothing is held twice and no float copy is made only to re-derive
    the blocks from it."""

    def __init__(self, path: str, tensors: list[TensorInfo], config: ModelConfig,
                 arch: str | None = None):
        self.path, self.config = path, config
        self.arch = arch or config.architecture  # the file's (llama.cpp's) architecture name
        self.file_tensors = tensors  # as the file lists them (a stack of experts is one)
        self.infos: dict[str, TensorInfo] = {}
        # the newer DeepSeek converter's attn_k_b / attn_v_b, joined back into kv_b_proj
        self._kv_b: dict[str, dict[str, TensorInfo]] = {}
        for t in tensors:
            experts = expert_names(t.name, t.shape, config, self.arch, path)
            if experts is not None:  # each expert's slice read as a matrix of its own
                self.infos.update(zip(experts, _expert_slices(t, len(experts))))
                continue
            half = kv_b_half(t.name, self.arch)
            if half is not None:
                self._kv_b.setdefault(half[0], {})[half[1]] = t
                continue
            self.infos[hf_name(t.name, path, self.arch)] = t
        c = config
        want = {"k": (c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim),
                "v": (c.num_attention_heads, c.v_head_dim, c.kv_lora_rank)}
        for name, halves in self._kv_b.items():
            if len(halves) != 2 or name in self.infos:
                raise ModelLoadError(f"{path}: {name} is neither attn_kv_b nor both of "
                                     f"attn_k_b and attn_v_b (found: {sorted(halves)})")
            for part, t in halves.items():
                if tuple(t.shape) != want[part]:
                    raise ModelLoadError(f"{path}: tensor {t.name} is {list(t.shape)}, not "
                                         f"{list(want[part])} ([heads, rank, nope] for "
                                         "attn_k_b, [heads, v, rank] for attn_v_b)")
        supported = {int(k) for k in supported_types()}
        for t in tensors:  # refuse at load, naming the tensor, not at the first use
            if t.ggml_type not in supported:
                raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type "
                                     f"{_type_name(t.ggml_type)} (supported: "
                                     f"{', '.join(sorted(k.name for k in supported_types()))})")
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __getitem__(self, name: str) -> torch.Tensor:
        from runtime.loading.gguf_blocks import APPROXIMATED

        if name in self._kv_b:
            return self._joined_kv_b(name)
        t = self.infos[name]
        blocks = None if t.ggml_type in APPROXIMATED else self.blocks(name)
        if blocks is not None:  # the same float32 values as gguf's dequantizer, faster
            return blocks.dequantized()
        tensor = self._rows(t.name)(_dequantize(self._mm, t, self.path))
        self._release(t)
        return tensor

    def __contains__(self, name: object) -> bool:
        # Mapping's own would read the tensor to find out
        return name in self.infos or name in self._kv_b

    def __iter__(self) -> Iterator[str]:
        yield from self.infos
        yield from self._kv_b

    def __len__(self) -> int:
        return len(self.infos) + len(self._kv_b)

    def blocks(self, name: str) -> BlockWeight | None:
        from runtime.loading.gguf_blocks import read_blocks

        if name in self._kv_b:  # joined from two transposed halves: floats only
            return None
        t = self.infos[name]
        rows = self._rows(t.name)
        form = read_blocks(self._mm, t.offset, t.shape, t.ggml_type,
                           None if rows is _same else rows)
        self._release(t)
        return form

    def _rows(self, name: str):
        """The reordering of a tensor's output rows that HF's layout needs (`_same`: none)."""
        if self.arch in PERMUTED_ARCHITECTURES and (".attn_q." in name or ".attn_k." in name):
            c = self.config
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            return lambda w: undo_llama_cpp_interleave(w, heads)
        # llama.cpp keeps DeepSeek's interleaved rotated rows (its graph rotates pairs)
        if self.arch == "deepseek2" and name.endswith((".attn_q.weight", ".attn_q_b.weight")):
            return lambda w: query_rows_in_halves(w, self.config)
        if self.arch == "deepseek2" and name.endswith(".attn_kv_a_mqa.weight"):
            return lambda w: latent_rows_in_halves(w, self.config)
        return _same

    def _joined_kv_b(self, name: str) -> torch.Tensor:
        """kv_b_proj [H * (nope + v), rank] from attn_k_b [H, rank, nope] and attn_v_b
        [H, v, rank]: per head, K's rows (k_b transposed back) then V's."""
        k_info, v_info = self._kv_b[name]["k"], self._kv_b[name]["v"]
        k_b = _dequantize(self._mm, k_info, self.path)
        v_b = _dequantize(self._mm, v_info, self.path)
        self._release(k_info)
        self._release(v_info)
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # shapes checked at load
        return joined.reshape(-1, self.config.kv_lora_rank).contiguous()

    def _release(self, t: TensorInfo) -> None:
        """Take the tensor's file pages out of this process's resident set once it is read.
        Most forms copy their fields out of the file's interleaved blocks (Q4_0's scale and
        nibbles apart; rows reordered): the pages those copies were read from would otherwise
        stay mapped and counted, doubling a worker's resident size (3B in Q4_0: 4.2 GiB where
        the file is 1.6). A form that keeps a view of the file (the K-quants) faults its pages
        back in from the page cache at first use: always correct, never a disk read twice."""
        page = mmap.PAGESIZE
        start = t.offset // page * page
        end = min(-(-(t.offset + t.nbytes) // page) * page, len(self._mm))
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def type_counts(self) -> dict[str, int]:
        """Tensors per GGUF type, most first (for the loading line)."""
        counts: dict[str, int] = {}
        for t in self.file_tensors:
            name = _type_name(t.ggml_type)
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def supported_types() -> set:
    """The tensor types read: the float ones, and every block type with a served form
    (runtime/loading/gguf_blocks.py; any other is refused at load, by name)."""
    from gguf import GGMLQuantizationType as Q

    from runtime.loading.gguf_blocks import BLOCK_SERVED

    return {Q.F32, Q.F16, Q.BF16, *(Q(t) for t in BLOCK_SERVED)}


def _dequantize(mm, t: TensorInfo, path: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(t.ggml_type)
    if kind not in supported_types():
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {kind.name}")
    raw = np.frombuffer(mm, np.uint8, count=t.nbytes, offset=t.offset)
    rows = raw.reshape(-1, t.nbytes // math.prod(t.shape[:-1]))  # one row per output row
    array = dequantize(rows, kind).reshape(t.shape)
    # F32 data is a read-only view of the mapped file; np.require copies only then
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


def _expert_slices(t: TensorInfo, experts: int) -> list[TensorInfo]:
    """A stacked [E, N, K] tensor's experts as [N, K] tensors of their own: expert e's rows
    (whole blocks, a row never straddles two experts) are bytes [e, e + 1) x nbytes / E."""
    each = t.nbytes // experts
    return [TensorInfo(f"{t.name}[{e}]", tuple(t.shape[1:]), t.ggml_type, t.offset + e * each,
                       each) for e in range(experts)]


def _tokenizer_metadata(meta: dict) -> dict:
    prefix = "tokenizer.ggml."
    out = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}
    out["chat_template"] = meta.get("tokenizer.chat_template")
    return out
