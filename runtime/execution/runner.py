"""Tensors live here: the KV cache, the step's input tensors, the forward pass and sampling.

`run(scheduler_output, requests)` packs the scheduled tokens as [decode tokens | prefill
chunks] into a few flat tensors moved in one copy (runtime/execution/step_inputs.py), runs the
model once (on CUDA a decode step replays the CUDA graph of its batch-size bucket,
runtime/execution/cuda_graphs.py; the KV pool's padding page is allocated here for it), computes
logits only for the requests that sample this step (and for the prompt positions of requests
gathering prompt logprobs), and returns their sampled tokens. `requests` maps ids to requests, read
for sampling state only; the runner's own per-request state (seeded generators, a draft model's
progress) lives here until the scheduler reports the request finished.
"""
from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

import kernels
from contract.config import EngineConfig, ModelConfig
from contract.outputs import PromptLogprob, StepSample
from runtime.execution import step_inputs
from runtime.execution.cuda_graphs import DecodeGraphs, capture_sizes
from runtime.execution.overlap import PendingStep, placeholder_fill
from runtime.execution.sampler import Sampler, SamplingRow, score_tokens
from runtime.kv.block_pool import padding_block_id
from runtime.kv.cache_format import cache_row_width, cache_shape, kv_bytes_per_token
from runtime.loading.calibration import Calibration, resolve_cache_dir
from runtime.loading.quantization import resolve as resolve_quantization
from runtime.models.attention import AttentionMetadata, RotaryTable
from runtime.models.llama import LlamaModel
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.scheduling.request import Request
from runtime.spec_decode.verify import verify
from runtime.structured.masks import MaskMaker, TokenMask
from runtime.structured.reasoning import grammar_waits

if TYPE_CHECKING:
    from runtime.spec_decode.drafter import Drafter

log = logging.getLogger("runtime.startup")
# prompt positions scored per LM-head call: bounds the [rows, vocab] logits a long chunk makes
PROMPT_LOGPROB_ROWS = 256


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    return getattr(torch, config.dtype)


def resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a model computing in `dtype`. `auto`: float16 where
    the compiled CPU attention reads it (a float32 model on the CPU: half the bytes decode
    attention waits for, twice the tokens in the same memory; llama.cpp's default too), else
    the model's own. The Triton kernels (CUDA) read only the model's dtype."""
    triton = config.device.startswith("cuda") or kernels.FORCE_TRITON
    if config.kv_cache_dtype == "auto":
        return torch.float16 if not triton and kernels.cpu_ops_take(dtype) else dtype
    chosen = getattr(torch, config.kv_cache_dtype)
    if triton and chosen != dtype:
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype}: the Triton kernels read "
                         f"only the model's dtype ({str(dtype).removeprefix('torch.')})")
    return chosen


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the kernel maps (zeroed) when first touched:
    `torch.zeros` of a 1 GiB cache wrote every page at start (0.2 s on a quiet machine, 0.7 s
    beside a test run) though a request touches only its own blocks. Anonymous memory is zero
    by definition, which malloc's recycled memory (what `torch.empty` may get) is not."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(1, nbytes))  # private, anonymous: the tensor keeps it alive
    return torch.frombuffer(memory, dtype=dtype, count=math.prod(shape)).view(shape)


def num_kv_blocks(model_cfg: ModelConfig, config: EngineConfig, kv_dtype: torch.dtype) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    per_token = kv_bytes_per_token(model_cfg, kv_dtype)  # an int8 row: its scale too
    return max(1, config.kv_cache_bytes // (per_token * config.block_size))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 config: EngineConfig, disk=None):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)  # the caches' element type
        self.model_cfg = model_cfg
        self.model = self.build_model(model_cfg, weights)
        self.block_size = config.block_size
        # the longest sequence (the engine's rule): sizes rotary tables and graphs' tables
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        self._rotary_tables: dict[tuple, RotaryTable] = {}
        self.num_blocks = num_kv_blocks(model_cfg, config, self.kv_dtype)
        # the page past the pool's: padding rows of graph buckets write and read only it
        self.padding_block = padding_block_id(self.num_blocks)
        self.kv_caches = self._allocate_kv_cache()
        self.sampler = Sampler(config.device, seed=config.seed)
        self.disk = disk  # the prefix cache's disk tier, or None
        # a model drafter for speculative decoding (self, draft model or MTP)
        self.drafter: Drafter | None = None
        self.masks: MaskMaker | None = None  # structured outputs' token masks (the engine's)
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own streams
        self.graphs = self._capture_graphs()  # decode steps' CUDA graphs, or None

    def build_model(self, model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor]
                    ) -> LlamaModel:
        """The model in this runner's device, dtype and (resolved) quantization; a draft
        model is built here too, so it gets the same."""
        quantization = resolve_quantization(self.config.quantization, model_cfg.weight_format,
                                            self.device.type)
        calibration = Calibration(resolve_cache_dir(None)) if quantization != "none" else None
        return LlamaModel(model_cfg, weights, self.config.device, self.dtype, quantization,
                          calibration, self.config.quant_max_rows)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's cache: [layers, tensors, block_size, cache heads, cache dim], tensors
        2 (K, V), or 1 where they share one (latent attention: its latent rows)."""
        c = self.model_cfg
        return (c.num_hidden_layers, c.kv_tensors, self.block_size, c.kv_cache_heads,
                cache_row_width(c.kv_cache_dim, self.kv_dtype))

    # ---- KV copies for the prefix cache's disk tier and PD transfers ---------------------
    def read_block(self, block_id: int) -> torch.Tensor:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        if self.model_cfg.kv_shared:  # K is V: its rows once
            return torch.stack([k[s] for k, _ in self.kv_caches]).unsqueeze(1).cpu()
        return torch.stack([torch.stack((k[s], v[s])) for k, v in self.kv_caches]).cpu()

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        kv = kv.to(device=self.device, dtype=self.kv_dtype)
        shared = self.model_cfg.kv_shared
        for layer, (k, v) in enumerate(self.kv_caches):
            k[s] = kv[layer, 0]
            if not shared:
                v[s] = kv[layer, 1]

    def apply_kv_transfers(self, transfers) -> None:
        """Save evicted blocks before anything overwrites them, then load disk hits."""
        for block_id, block_hash, tokens in transfers.saves:
            if self.disk is not None:
                self.disk.save_async(block_hash, tokens, self.read_block(block_id))
        for block_id, kv in transfers.loads:
            self.write_block(block_id, kv)

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer its (K, V) caches [slots, cache heads, cache dim]; where K and V share one
        tensor (latent attention) the pair is that tensor twice, allocated once."""
        start = time.perf_counter()
        c = self.model_cfg
        # + the padding page; an int8 cache's rows end in their scales
        shape = cache_shape(c, (self.num_blocks + 1) * self.block_size, self.kv_dtype)
        layers, tensors = c.num_hidden_layers, c.kv_tensors
        if self.device.type == "cpu":
            caches = lazily_zeroed((layers, tensors, *shape), self.kv_dtype)
        else:
            caches = torch.zeros((layers, tensors, *shape), dtype=self.kv_dtype,
                                 device=self.device)
        nbytes = caches.numel() * caches.element_size()
        log.info("KV cache: %s blocks (%s tokens, %.1f GiB %s%s) in %.2f s",
                 f"{self.num_blocks:,}", f"{self.num_blocks * self.block_size:,}",
                 nbytes / 2 ** 30, str(self.kv_dtype).removeprefix("torch."),
                 f", latent: {c.kv_cache_dim} values per token and layer" if c.kv_shared
                 else "", time.perf_counter() - start)
        return [(caches[i, 0], caches[i, tensors - 1]) for i in range(layers)]

    # ---- per-request state -------------------------------------------------------------
    def _generator(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator, made at its first sample and kept across
        preemption, so its draws do not depend on what it was batched with."""
        if request.params.seed is None:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            g = self._generators[request.request_id] = torch.Generator(device=self.device)
            g.manual_seed(request.params.seed)
        return g

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the state of requests that left (their ids may be reused)."""
        for rid in request_ids:
            self._generators.pop(rid, None)
        if self.drafter is not None:
            self.drafter.forget(request_ids)

    # ---- packing ----------------------------------------------------------------------
    def prepare(self, batch: Sequence[ScheduledRequest], model_cfg: ModelConfig | None = None):
        """Order tokens as [decodes | prefills]; return (input_ids, meta, last_index), where
        last_index maps a request id to the row of its last token (proposals included)."""
        host, t = self._pack(batch)
        meta = AttentionMetadata.build(t, host.layout, self.block_size,
                                       self._rotary(model_cfg or self.model_cfg))
        return t.input_ids, meta, host.last_index

    def _pack(self, batch: Sequence[ScheduledRequest]
              ) -> tuple[step_inputs.HostStep, step_inputs.StepTensors]:
        host = step_inputs.pack(batch, self.block_size)
        return host, step_inputs.views(step_inputs.to_device(host.values, self.device),
                                       host.layout)

    def _rotary(self, cfg: ModelConfig) -> RotaryTable:
        """The rotary tables of a model's rope (the target's, or a draft model's)."""
        key = RotaryTable.key(cfg)
        table = self._rotary_tables.get(key)
        if table is None:
            table = self._rotary_tables[key] = RotaryTable(
                self.max_model_len, cfg, self.dtype, self.device)
        return table

    def _forward_packed(self, t: step_inputs.StepTensors,
                        layout: step_inputs.StepLayout) -> torch.Tensor:
        """The target model over packed inputs: what a CUDA graph captures."""
        meta = AttentionMetadata.build(t, layout, self.block_size, self._rotary(self.model_cfg))
        return self.model.forward(t.input_ids, meta, self.kv_caches)

    def _forward(self, batch: Sequence[ScheduledRequest], previous: PendingStep | None = None
                 ) -> tuple[torch.Tensor, step_inputs.HostStep, step_inputs.StepTensors]:
        """Hidden states of the step's tokens and its packed inputs: a graph's replay when
        the step fits a bucket, else an eager forward. Placeholder tokens are filled in
        from `previous` (the step still in flight) on the device first; a step run in order
        has none, and nothing scans it for them."""
        fill = None
        if previous is not None:
            def fill(host: step_inputs.HostStep, input_ids: torch.Tensor) -> None:
                write = placeholder_fill(batch, host.last_index, previous, self.device)
                if write is not None:
                    write(input_ids)
        if self.graphs is not None:
            replayed = self.graphs.run(batch, fill)
            if replayed is not None:
                return replayed
        host, t = self._pack(batch)
        if fill is not None:
            fill(host, t.input_ids)
        return self._forward_packed(t, host.layout), host, t

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not self.config.cuda_graphs or DecodeGraphs.supported(self.device) is not None:
            return None
        if self.model_cfg.num_experts:
            # a captured MoE step could not group its tokens by expert (the run lengths are
            # read on the host): it would run every expert on every row, and replays would
            # go uncounted in the expert load
            return None
        self._rotary(self.model_cfg)  # built outside the capture, which only reads it
        graphs = DecodeGraphs(self._forward_packed, self.device, self.block_size,
                              -(-self.max_model_len // self.block_size), self.padding_block,
                              capture_sizes(self.config.max_num_seqs))
        graphs.capture()
        return graphs

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> StepSample:
        """Run the scheduled tokens; sample (or verify proposals) for each scheduled request
        that reaches its sequence's end."""
        self.forget(out.finished_request_ids)
        self.apply_kv_transfers(out.kv_transfers)
        if out.is_empty:
            return StepSample()
        batch = self._with_drafts(out, requests)
        hidden, host, packed = self._forward(batch)
        last_index = host.last_index
        sampling = [s for s in batch if s.samples]
        masks = self._grammar_masks(sampling, requests)
        plain = self._sample_plain(sampling, requests, hidden, packed, masks)
        result = plain.result()
        for s in sampling:
            k = s.num_spec
            if k:
                r = requests[s.request_id]
                last = last_index[s.request_id]
                logits = self.model.compute_logits(hidden[last - k:last + 1])
                if s.request_id in masks:  # each position's grammar mask: refused drafts fail
                    logits = TokenMask(list(range(k + 1)), masks[s.request_id]).apply(logits)
                tokens = verify(logits, list(s.spec_token_ids[:k]), r.params, self._generator(r))
                result.tokens[s.request_id] = tokens
                result.rejected[s.request_id] = k - (len(tokens) - 1)
        if self.drafter is not None and self.drafter.follows_target:  # MTP: its rows now
            self.drafter.observe(batch, requests, self.model.prenorm, last_index, result)
        self._score_prompts(batch, requests, hidden, last_index, result)
        return result

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, requests: Mapping[str, Request],
               previous: PendingStep | None) -> PendingStep:
        """Run a step without waiting for what it samples (runtime/execution/overlap.py): its
        placeholder tokens come from `previous` on the device, its tokens stay there until
        `result()`. Plain steps only: no proposals, grammars or penalties."""
        self.forget(out.finished_request_ids)
        self.apply_kv_transfers(out.kv_transfers)
        if out.is_empty:
            return PendingStep()
        batch = list(out.scheduled)
        if any(s.num_spec for s in batch):
            raise ValueError("a step with proposals cannot be launched ahead of its reads")
        hidden, host, packed = self._forward(batch, previous)
        pending = self._sample_plain([s for s in batch if s.samples], requests, hidden,
                                     packed, {})
        self._score_prompts(batch, requests, hidden, host.last_index, pending.partial)
        return pending

    def _sample_plain(self, sampling: Sequence[ScheduledRequest],
                      requests: Mapping[str, Request], hidden: torch.Tensor,
                      packed: step_inputs.StepTensors, masks: dict[str, torch.Tensor]
                      ) -> PendingStep:
        """Sample every request without proposals in one call, its tokens left on the
        device; their rows came with the step's inputs, so no copy waits for the forward."""
        plain = [requests[s.request_id] for s in sampling if not s.num_spec]
        if not plain:
            return PendingStep()
        logits = self.model.compute_logits(hidden.index_select(0, packed.sample_rows))
        rows = [SamplingRow(r.params, self._generator(r), r.prompt_token_ids,
                            r.output_token_ids) for r in plain]
        masked = [i for i, r in enumerate(plain) if r.request_id in masks]
        mask = TokenMask(masked, torch.cat([masks[plain[i].request_id] for i in masked])
                         ) if masked else None
        return PendingStep(self.sampler.sample(logits, rows, mask),
                           {r.request_id: i for i, r in enumerate(plain)})

    def _grammar_masks(self, sampling: Sequence[ScheduledRequest],
                       requests: Mapping[str, Request]) -> dict[str, torch.Tensor]:
        """Bitmask rows of each constrained request that samples this step, by id: its next
        token's, then one after each of its proposals (all made in one batched call)."""
        constrained = [s for s in sampling if requests[s.request_id].grammar is not None
                       and not grammar_waits(requests[s.request_id])]  # thinking: free
        if not constrained or self.masks is None:
            return {}
        entries = []
        for s in constrained:
            grammar = requests[s.request_id].grammar
            assert grammar is not None and grammar.matcher is not None  # the scheduler waited
            entries.append((grammar.matcher, list(s.spec_token_ids[:s.num_spec])))
        bits, first = self.masks.fill(entries)
        return {s.request_id: bits[f:f + 1 + s.num_spec] for s, f in zip(constrained, first)}

    def _score_prompts(self, batch: Sequence[ScheduledRequest], requests: Mapping[str, Request],
                       hidden: torch.Tensor, last_index: dict[str, int],
                       result: StepSample) -> None:
        """Prompt logprobs at the positions each gathering request runs this step: the row of
        position p scores prompt token p + 1, so a chunk's last row scores the next chunk's
        first token. Positions already held (a recompute after preemption) are skipped."""
        for s in batch:
            r = requests[s.request_id]
            if not r.needs_prompt_logprobs:
                continue
            first = max(s.start_position, len(r.prompt_logprobs) - 1)
            end = min(s.start_position + len(s.token_ids), r.num_prompt_tokens - 1)
            if first >= end:
                continue  # the prompt's last position samples; it scores no prompt token
            row0 = last_index[s.request_id] - (s.num_new_tokens - 1) - s.start_position
            entries: list[PromptLogprob] = []
            for lo in range(first, end, PROMPT_LOGPROB_ROWS):
                hi = min(lo + PROMPT_LOGPROB_ROWS, end)
                logits = self.model.compute_logits(hidden[row0 + lo:row0 + hi])
                targets = torch.tensor(r.prompt_token_ids[lo + 1:hi + 1], device=self.device)
                entries += score_tokens(logits, targets, r.params.prompt_logprobs)
            result.prompt_logprobs[s.request_id] = (first + 1, entries)

    def _with_drafts(self, out: SchedulerOutput,
                     requests: Mapping[str, Request]) -> list[ScheduledRequest]:
        """The step's batch with every proposal in place: n-gram proposals came with the
        schedule; a model drafter makes its own now (a draft model catching up first)."""
        if self.drafter is None or not any(s.num_spec for s in out.scheduled):
            return list(out.scheduled)
        drafts = self.drafter.propose(out, requests)
        return [replace(s, spec_token_ids=drafts[s.request_id]) if s.num_spec else s
                for s in out.scheduled]

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled position (scoring and tests; the step path skips this)."""
        self.apply_kv_transfers(out.kv_transfers)
        input_ids, meta, _ = self.prepare(out.scheduled)
        return self.model.compute_logits(self.model.forward(input_ids, meta, self.kv_caches))
