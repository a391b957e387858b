"""Tensors live here: the KV cache, the step's input tensors, the forward pass and sampling.

`run(scheduler_output, sampling_requests)` packs the scheduled tokens as
[decode tokens | prefill chunks], runs the model once, computes logits only for the requests
that sample this step, and returns their sampled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from runtime.attention import AttentionMetadata, PrefillSeq
from runtime.config import EngineConfig, ModelConfig
from runtime.model import LlamaModel
from runtime.request import Request
from runtime.outputs import TokenLogprob
from runtime.sampler import Sampler, SamplingRow
from runtime.spec_decode.verify import verify
from runtime.scheduler import SchedulerOutput


@dataclass
class StepSample:
    """What one step sampled: new tokens per request (several when proposals were accepted),
    logprobs where asked, and how many proposed tokens each speculating request rejected."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    return getattr(torch, config.dtype)


def num_kv_blocks(model_cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    per_token = model_cfg.kv_bytes_per_token // 4 * torch.finfo(dtype).bits // 8
    return max(1, config.kv_cache_bytes // (per_token * config.block_size))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 config: EngineConfig, disk=None):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        self.model = LlamaModel(model_cfg, weights, config.device, self.dtype)
        self.model_cfg = model_cfg
        self.block_size = config.block_size
        self.num_blocks = num_kv_blocks(model_cfg, config, self.dtype)
        self.kv_caches = self._allocate_kv_cache()
        self.sampler = Sampler(config.device, seed=config.seed)
        self.disk = disk  # the prefix cache's disk tier, or None
        self.drafter = None  # a model drafter for speculative decoding (self or draft model)

    @property
    def block_shape(self) -> tuple[int, ...]:
        c = self.model_cfg
        return (c.num_hidden_layers, 2, self.block_size, c.num_key_value_heads, c.head_dim)

    # ---- KV copies for the prefix cache's disk tier -------------------------------------
    def read_block(self, block_id: int) -> torch.Tensor:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return torch.stack([torch.stack((k[s], v[s])) for k, v in self.kv_caches]).cpu()

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        kv = kv.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[s] = kv[layer, 0]
            v[s] = kv[layer, 1]

    def apply_kv_transfers(self, transfers) -> None:
        """Save evicted blocks before anything overwrites them, then load disk hits."""
        for block_id, block_hash, tokens in transfers.saves:
            if self.disk is not None:
                self.disk.save_async(block_hash, tokens, self.read_block(block_id))
        for block_id, kv in transfers.loads:
            self.write_block(block_id, kv)

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.num_blocks * self.block_size, self.model_cfg.num_key_value_heads,
                 self.model_cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.model_cfg.num_hidden_layers)]

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    # ---- packing ----------------------------------------------------------------------
    def _slots(self, request: Request, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(request.block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, out: SchedulerOutput, model_cfg: ModelConfig | None = None):
        """Order tokens as [decodes | prefills]; return (input_ids, meta, last_index), where
        last_index maps a request id to the row of its last scheduled token."""
        model_cfg = model_cfg or self.model_cfg
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        bs = self.block_size
        # a decode needs only its new token's position and slot: plain ints, no tensors
        ids, positions, last_index = [], [], {}
        slot_chunks = [torch.tensor([s.request.block_ids[s.start_position // bs] * bs
                                     + s.start_position % bs for s in decodes],
                                    dtype=torch.long)]
        for i, s in enumerate(decodes):
            ids.extend(s.request.token_slice_with_spec(s.start_position, s.start_position + 1))
            last_index[s.request.request_id] = i
        positions.append(torch.tensor([s.start_position for s in decodes], dtype=torch.long))
        pre_meta, offset = [], len(decodes)
        for s in prefills:
            r, start, n = s.request, s.start_position, s.num_new_tokens
            ids.extend(r.token_slice_with_spec(start, start + n))
            positions.append(torch.arange(start, start + n))
            ctx_slots = self._slots(r, 0, start + n)
            slot_chunks.append(ctx_slots[start:])
            pre_meta.append(PrefillSeq(offset, n, start, ctx_slots.to(self.device)))
            offset += n
            last_index[r.request_id] = offset - 1
        decode_slots = decode_valid = None
        if decodes:
            rows = [s.request.block_ids for s in decodes]
            width = max(len(t) for t in rows)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.long)
            lens = torch.tensor([s.start_position + 1 for s in decodes], dtype=torch.long)
            decode_slots, decode_valid = kernels.context_slots(tables, lens, bs)
            decode_slots = decode_slots.to(self.device)
            decode_valid = decode_valid.to(self.device)
        pos = torch.cat(positions).to(self.device)
        cos, sin = kernels.rotary_cos_sin(pos, model_cfg.head_dim, model_cfg.rope_theta,
                                          self.dtype)
        meta = AttentionMetadata(torch.cat(slot_chunks).to(self.device), cos, sin, len(decodes),
                                 decode_slots, decode_valid, pre_meta)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, meta, last_index

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput, sampling: list[Request]) -> StepSample:
        """Run the scheduled tokens; sample (or verify proposals) for each request in
        `sampling`, which are the scheduled requests that reach their sequence's end."""
        self.apply_kv_transfers(out.kv_transfers)
        result = StepSample()
        if out.is_empty:
            return result
        spec = {s.request.request_id: s.num_spec for s in out.scheduled if s.num_spec}
        if self.drafter is not None and spec:  # a draft model catches up lazily, from
            self.drafter.propose(out)          # each request's `draft_written` position
        input_ids, meta, last_index = self.prepare(out)
        hidden = self.model.forward(input_ids, meta, self.kv_caches)
        plain = [r for r in sampling if r.request_id not in spec]
        if plain:
            idx = torch.tensor([last_index[r.request_id] for r in plain], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            rows = [SamplingRow(r.params, r.generator, r.prompt_token_ids, r.output_token_ids)
                    for r in plain]
            sampled = self.sampler(logits, rows)
            for i, r in enumerate(plain):
                result.tokens[r.request_id] = [sampled.token_ids[i]]
                if sampled.logprobs[i] is not None:
                    result.logprobs[r.request_id] = [TokenLogprob(
                        sampled.token_ids[i], sampled.logprobs[i],
                        tuple(sampled.top_logprobs[i] or ()))]
        for r in sampling:
            k = spec.get(r.request_id, 0)
            if k:
                last = last_index[r.request_id]
                logits = self.model.compute_logits(hidden[last - k:last + 1])
                tokens = verify(logits, r.spec_token_ids[:k], r.params, r.generator)
                result.tokens[r.request_id] = tokens
                result.rejected[r.request_id] = k - (len(tokens) - 1)
        return result

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled position (scoring and tests; the step path skips this)."""
        self.apply_kv_transfers(out.kv_transfers)
        input_ids, meta, _ = self.prepare(out)
        return self.model.compute_logits(self.model.forward(input_ids, meta, self.kv_caches))
