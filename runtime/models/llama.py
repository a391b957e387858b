"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights arrive with Hugging Face names; q/k/v and gate/up are fused into one matmul each,
which is what makes the CPU path fast, and each matmul is a `runtime/models/linear.py` Linear:
float, or weight-only quantized for small steps (`quantization` int8/int4). A GGUF's quantized
matrices come as the file's own blocks (`ModelWeights.matrix`): with int4 they are served as
they are (fused parts stacked), otherwise dequantized, as any float weight. Tokens of all requests
in a step are flattened into one [T, hidden] batch; only attention knows about request boundaries
(see runtime/models/attention.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import kernels
from contract.config import ModelConfig
from runtime.loading.calibration import Calibration
from runtime.loading.quantization import (
    INT4_GROUP,
    BlockWeight,
    Int4Weight,
    Int8BlockWeight,
    Int8Weight,
)
from runtime.models.attention import AttentionMetadata, PagedAttention
from runtime.models.linear import Linear

log = logging.getLogger("runtime.startup")


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the weights' reading and float copies on one intra-op thread: they are many small,
    memory-bound ops, and with another process on the second core every op's OpenMP barrier
    waits out a scheduler slice (dequantizing SmolLM2 took 12-20 s on two threads beside a
    test run, 0.6 s on one; runtime/execution/thread_governor.py describes the effect)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _log_build(linear: LinearMaker, w: ModelWeights, build_s: float, crossover_s: float):
    forms = ", ".join(f"{form} {n}" for form, n in linear.forms.items())
    floats = sum(lin.weight.numel() * lin.weight.element_size() for lin in linear.made)
    log.info("model built in %.2f s (tensors read %.2f s, float copies %.2f s, %d MiB): "
             "%d matrices as %s; %d vectors", build_s, w.read_seconds, linear.float_seconds,
             floats >> 20, len(linear.made), forms, w.vectors)
    c = linear.calibration
    saved = {"settled": f"saved to {c.path}", "provisional":
             f"the machine is busy: kept as provisional in {c.busy_path}"}.get(c.saved_as,
                                                                                "not saved")
    if c.measured:
        log.info("kernel crossovers: %d shapes measured in %.1f s (%s)", c.measured, c.seconds,
                 saved)
    elif linear.max_quant_rows is None and linear.forms.keys() - {"float"}:
        log.info("kernel crossovers: read from %s in %.2f s", c.busy_path + " (provisional: "
                 "the machine is busy)" if c.used_provisional else c.path, crossover_s)


class ModelWeights:
    """The checkpoint's tensors as the model takes them: float on the model's device and in
    its dtype, or, for a matrix, the file's own blocks where the checkpoint's mapping offers
    them (runtime/loading/gguf.py `GGUFWeights.blocks`): read once, in the form served."""

    def __init__(self, weights: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.weights, self.device, self.dtype = weights, device, dtype
        self._blocks = getattr(weights, "blocks", None)
        self.read_seconds = 0.0  # reading (and dequantizing) tensors, for the start-up line
        self.vectors = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def tensor(self, name: str) -> torch.Tensor:
        start = time.perf_counter()
        t = self.weights[name].to(device=self.device, dtype=self.dtype)
        self.read_seconds += time.perf_counter() - start
        self.vectors += t.dim() == 1
        return t

    def matrix(self, name: str) -> torch.Tensor | BlockWeight:
        if self._blocks is None:
            return self.tensor(name)
        start = time.perf_counter()
        blocks = self._blocks(name)
        self.read_seconds += time.perf_counter() - start
        return blocks if blocks is not None else self.tensor(name)


class LinearMaker:
    """Builds the model's Linears in one format; with quantization, the packed weight, its
    float dequantization (the large-step path) and the measured crossover between them."""

    def __init__(self, quantization: str, dtype: torch.dtype, calibration: Calibration | None,
                 max_quant_rows: int | None, device: torch.device | None = None):
        self.quantization = quantization
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.calibration = calibration or Calibration(None)
        self.max_quant_rows = max_quant_rows  # None: measured per shape
        self.packed_bytes = 0
        self.made: list[Linear] = []
        self.forms: dict[str, int] = {}  # matrices by the form served, for the start-up line
        self.float_seconds = 0.0  # making the float copies

    def __call__(self, parts: Sequence[torch.Tensor | BlockWeight],
                 bias: torch.Tensor | None = None) -> Linear:
        """The Linear of `parts` stacked along N (one matrix, or fused q/k/v, gate/up).
        Its crossover is set later, by `set_crossovers`."""
        small = self._file_blocks(parts)
        if small is not None:  # the file's own blocks, and the same weights in float
            linear = Linear(self._timed(lambda: small.dequantized().to(self.dtype)), bias,
                            small=small)
            self._note(f"{small.kind} (file blocks)", small.nbytes)
        else:
            linear = self._from_float(self._float(parts), bias)
        self.made.append(linear)
        return linear

    def _from_float(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A float weight's Linear, in the format asked for (the path of every weight a
        checkpoint holds in float, or in blocks not served as such)."""
        if self.quantization == "none":
            self._note("float", 0)
            return Linear(weight.contiguous(), bias)
        small = self._exact_blocks(weight)
        if small is not None:  # int4: the blocks a float copy holds exactly
            self._note(f"{small.kind} (from float)", small.nbytes)
            return Linear(weight.to(self.dtype).contiguous(), bias, small=small)
        packed = Int8Weight(weight)
        self._note(packed.kind, packed.nbytes)
        return Linear(packed.dequantized().to(self.dtype).contiguous(), bias, packed)

    def set_crossovers(self) -> None:
        """Each quantized Linear's crossover, measured (or found in the calibration's table)
        once every weight is in place, with the thread count the steps will use."""
        for linear in self.made:
            if linear.small is not None:
                linear.max_small_rows = self._crossover(linear.small.kind, linear.weight,
                                                        linear.small)
            elif linear.packed is not None:
                linear.max_quant_rows = self._crossover("int8", linear.weight, linear.packed)

    def _crossover(self, kind: str, dense: torch.Tensor, packed: Int8Weight | BlockWeight) -> int:
        if self.max_quant_rows is not None:
            return self.max_quant_rows
        return self.calibration.max_quant_rows(kind, dense, packed)

    def _file_blocks(self, parts: Sequence[torch.Tensor | BlockWeight]) -> BlockWeight | None:
        """With int4 where the C kernel runs, the parts' blocks stacked when they all came in
        one block form; else None (a float path takes them)."""
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if not self._serves_blocks() or len(blocks) != len(parts):
            return None
        form = type(blocks[0])
        if not all(type(b) is form for b in blocks):
            return None  # 4- and 8-bit parts: one matrix cannot hold both
        return form.cat(blocks)  # type: ignore[arg-type]

    def _float(self, parts: Sequence[torch.Tensor | BlockWeight]) -> torch.Tensor:
        def one(p: torch.Tensor | BlockWeight) -> torch.Tensor:
            if isinstance(p, BlockWeight):
                return self._timed(lambda: p.dequantized().to(self.device, self.dtype))
            return p
        floats = [one(p) for p in parts]
        return floats[0] if len(floats) == 1 else torch.cat(floats)

    def _timed(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        t = make()
        self.float_seconds += time.perf_counter() - start
        return t

    def _note(self, form: str, nbytes: int) -> None:
        self.forms[form] = self.forms.get(form, 0) + 1
        self.packed_bytes += nbytes

    def _serves_blocks(self) -> bool:
        return self.quantization == "int4" and self.device.type == "cpu" \
            and kernels.cpu_ops_take(self.dtype)

    def _exact_blocks(self, weight: torch.Tensor) -> BlockWeight | None:
        """With int4, a float weight in the block form that holds it exactly (4-bit, else
        8-bit), where the C kernel runs it; a weight neither form holds exactly (a float
        checkpoint's) goes int8 per row instead: nothing is rounded to fit a block."""
        if not self._serves_blocks() or weight.shape[1] % INT4_GROUP \
                or weight.device.type != "cpu":
            return None
        for form in (Int4Weight, Int8BlockWeight):
            small = form(weight)
            if small.exact:
                return small
        return None


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: ModelWeights, prefix: str, linear: LinearMaker):
        a = prefix + "self_attn."
        qkv_bias = None
        if cfg.attention_bias or (a + "q_proj.bias") in w:
            qkv_bias = torch.cat([w.tensor(a + "q_proj.bias"), w.tensor(a + "k_proj.bias"),
                                  w.tensor(a + "v_proj.bias")]).contiguous()
        self.qkv = linear([w.matrix(a + "q_proj.weight"), w.matrix(a + "k_proj.weight"),
                           w.matrix(a + "v_proj.weight")], qkv_bias)
        self.o_proj = linear([w.matrix(a + "o_proj.weight")])
        m = prefix + "mlp."
        self.gate_up = linear([w.matrix(m + "gate_proj.weight"), w.matrix(m + "up_proj.weight")])
        self.down = linear([w.matrix(m + "down_proj.weight")])
        self.input_norm = w.tensor(prefix + "input_layernorm.weight")
        self.post_norm = w.tensor(prefix + "post_attention_layernorm.weight")
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata):
        if residual is None:
            residual = x
            h = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = kernels.rms_norm(x, self.input_norm, self.eps, residual)
        t = h.shape[0]
        qkv = self.qkv(h)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # one rotary call covers the query and key heads together
        qk = kernels.apply_rotary(qkv[:, :nq + nk].view(t, -1, self.head_dim), meta.cos, meta.sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, nq + nk:].view(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, k_cache, v_cache, meta)
        h = self.o_proj(attn.reshape(t, nq))
        h, residual = kernels.rms_norm(h, self.post_norm, self.eps, residual)
        h = self.down(kernels.silu_and_mul(self.gate_up(h)))
        return h, residual


class LlamaModel:
    """Inference-only: plain tensors, no autograd, no nn.Module bookkeeping per call."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 quantization: str = "none", calibration: Calibration | None = None,
                 max_quant_rows: int | None = None):
        start = time.perf_counter()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantization = quantization
        linear = LinearMaker(quantization, dtype, calibration, max_quant_rows, self.device)
        w = ModelWeights(weights, self.device, dtype)
        with one_thread():
            self._build(cfg, w, linear)
        built = time.perf_counter()
        linear.set_crossovers()
        self.packed_bytes = linear.packed_bytes
        linear.calibration.save()
        # decode-only steps run each layer as one C call where the layers fit it (CPU int8)
        self.fused = kernels.fused_decoder(self.layers, dtype) if self.device.type == "cpu" \
            else None
        _log_build(linear, w, built - start, time.perf_counter() - built)

    def _build(self, cfg: ModelConfig, w: ModelWeights, linear: LinearMaker) -> None:
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.", linear)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = w.tensor("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in w:
            # tied: the embedding rows are the head's weights, quantized alike
            self.lm_head = linear([w.matrix("model.embed_tokens.weight")])
            self.embed = self.lm_head.weight
        else:
            self.embed = w.tensor("model.embed_tokens.weight").contiguous()
            self.lm_head = linear([w.matrix("lm_head.weight")])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids: [T]; returns final hidden states [T, hidden] (before the LM head)."""
        x = F.embedding(input_ids, self.embed)
        if self.fused is not None and self.fused.takes(meta, x.shape[0], kv_caches):
            x, residual = self.fused.forward(x, meta, kv_caches)
        else:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x, residual = layer.forward(x, residual, k_cache, v_cache, meta)
        x, _ = kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def linears(self) -> list[Linear]:
        """Every Linear, the head last (benchmarks time them; the engine counts their bytes)."""
        return [lin for layer in self.layers
                for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [self.lm_head]
