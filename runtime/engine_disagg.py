"""The engine's side of prefill/decode disaggregation: park a request after its first token,
export its prompt blocks, import another worker's, and let the import join the batch.
`runtime/transport/disagg.py` moves the blocks between workers; `LLMEngine` inherits these
methods."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from contract.outputs import wall_clock
from contract.sampling_params import SamplingParams
from runtime.detokenizer import IncrementalDetokenizer
from runtime.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from contract.tokenizer import Tokenizer
    from runtime.execution.runner import ModelRunner
    from runtime.kv.manager import KVCacheManager
    from runtime.scheduling.scheduler import Scheduler
    from runtime.structured.manager import StructuredOutputs


class Disaggregation:
    """Methods over the engine's own parts; the engine sets these attributes."""

    if TYPE_CHECKING:
        requests: dict[str, Request]
        scheduler: Scheduler
        kv: KVCacheManager
        runner: ModelRunner
        structured: StructuredOutputs
        tokenizer: Tokenizer

        def validate(self, request_id, prompt_token_ids, params, priority=0,
                     cache_salt=None) -> None: ...

    def park_request(self, request_id: str) -> bool:
        """Take a running request out of the batch, keeping its blocks: a prefill worker's
        request waits here, after its first token, for its KV to be exported."""
        request = self.requests.get(request_id)
        if request is None or request not in self.scheduler.running:
            return False
        self.scheduler.running.remove(request)
        request.status = RequestStatus.PARKED  # a step in flight drops what it sampled for it
        return True

    def request_timing(self, request_id: str) -> dict:
        request = self.requests[request_id]
        return {"arrival": wall_clock(request.arrival_time),
                "scheduled": wall_clock(request.first_scheduled_time),
                "first_token": wall_clock(request.first_token_time)}

    def export_request(self, request_id: str) -> list[torch.Tensor] | None:
        """Copy a parked request's prompt blocks out (one CPU tensor per block, see
        `ModelRunner.read_block`) and release it: its full blocks stay in the prefix cache.
        None for an unknown request (aborted meanwhile)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        n = self.kv.num_blocks_for(request.num_prompt_tokens)
        blocks = [self.runner.read_block(b) for b in self.kv.block_ids(request_id)[:n]]
        self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
        return blocks

    def import_request(self, request_id: str, prompt_token_ids: list[int],
                       output_token_ids: list[int], params: SamplingParams = SamplingParams(),
                       priority: int = 0, cache_salt: str | None = None,
                       num_cached_tokens: int = 0) -> list[int]:
        """Admit a request whose prompt KV another worker computed: blocks for the prompt are
        allocated now (their ids returned, in order) and it stays out of the batch until
        `finish_import`. `output_token_ids` are the tokens already sampled and streamed (and
        any prompt logprobs went out with them: the request here gathers none)."""
        self.validate(request_id, prompt_token_ids, params, priority, cache_salt)
        request = Request(request_id, list(prompt_token_ids), params, priority,
                          time.monotonic(), cache_salt)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, stop=params.stop)
        for token in output_token_ids:
            request.output_token_ids.append(token)
            request.detokenizer.push([token])  # its text was streamed by the prefill worker
        self.structured.attach(request)  # its matcher replays those tokens once compiled
        num_blocks = self.kv.num_blocks_for(request.num_prompt_tokens)
        if num_blocks > self.kv.num_free_blocks:
            raise MemoryError("the prompt's KV does not fit in this worker's cache")
        block_ids = self.kv.allocate_blocks(request_id, num_blocks)
        self.runner.apply_kv_transfers(self.kv.take_transfers())  # evicted blocks saved first
        request.num_cached_tokens = num_cached_tokens
        request.first_token_time = request.arrival_time
        self.requests[request_id] = request
        return block_ids

    def finish_import(self, request_id: str) -> bool:
        """Every prompt block is written: the request joins the batch at its first token."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = time.monotonic()
        self.scheduler.running.append(request)
        return True
