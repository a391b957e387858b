"""The engine: add and abort requests, and step. Each step reads in three lines: schedule, run,
postprocess. Tensors stay in the model runner; bookkeeping stays here; what a step reports for
a request is built by runtime/request_outputs.py. For prefill/decode disaggregation it also
parks a request after its first token, exports its prompt blocks and imports another worker's."""
from __future__ import annotations

import os
import time

import torch

from contract.config import EngineConfig
from contract.errors import DuplicateRequestError
from contract.frames import KvEvents
from contract.model_families import with_family_defaults
from contract.outputs import EngineCounters, RequestOutput, StepSample, StepStats
from contract.sampling_params import SamplingParams
from contract.tokenizer import load_chat_template
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_checks import check_device, context_length
from runtime.execution.overlap import InFlight, needs_ordered_steps, overlap_enabled
from runtime.execution.runner import ModelRunner
from runtime.execution.thread_governor import ThreadGovernor
from runtime.kv.disk_cache import DiskKVCache
from runtime.kv.manager import KVCacheManager
from runtime.loading.heap import release_freed_heap
from runtime.loading.loader import Checkpoint, load_checkpoint
from runtime.request_outputs import count_spec, finish_status, request_output, timing
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.scheduling.request import Request, RequestStatus
from runtime.scheduling.scheduler import Scheduler
from runtime.scheduling.validate import validate_request
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.drafter import draft_cost, make_drafter
from runtime.structured.manager import GrammarError, StructuredOutputs
from runtime.structured.reasoning import grammar_waits, think_budget

GRAMMAR_WAIT_S = 0.02  # the longest a step with nothing to run waits for a compile


class LLMEngine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig()):
        check_device(config.device)
        self.checkpoint = checkpoint
        # a family's chat template and end of turn where the file lacks them (Gemma 3 GGUFs)
        self.model_config, tokenizer = with_family_defaults(checkpoint.config,
                                                            checkpoint.tokenizer)
        self.tokenizer = tokenizer.with_chat_template(load_chat_template(config.chat_template))
        self.config = config
        self.max_model_len = context_length(config.max_model_len, self.model_config.name,
                                            self.model_config.max_position_embeddings)
        self.runner = ModelRunner(self.model_config, checkpoint.weights, config)
        self.disk_cache = self._open_disk_cache()
        self.runner.disk = self.disk_cache
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, self.model_id, self.disk_cache)
        self.spec = SpecConfig.parse(config.spec, config.num_spec_tokens, config.spec_max_batch)
        self.runner.drafter = make_drafter(self.spec, self.runner, checkpoint.weights)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, self.spec,
                                   draft_cost(self.runner))
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.model_config.eos_token_ids)
        self.runner.masks = self.structured.masks
        # a GPU's launches do not wait on CPU threads: only the CPU path adapts its count
        self.threads = ThreadGovernor(policy=config.thread_policy
                                      if self.runner.device.type == "cpu" else "fixed")
        self.overlap = overlap_enabled(config.overlap, self.runner.device)
        self.inflight: InFlight | None = None  # the step launched last, not read back yet
        release_freed_heap()  # the load's temporaries, back to the operating system

    @property
    def model_id(self) -> str:
        """Identity of the weights and KV layout: prefix-cache hashes are rooted in it."""
        src = self.checkpoint.source
        try:
            st = os.stat(src)
            stamp = f"{st.st_size}:{int(st.st_mtime)}"
        except OSError:
            stamp = "?"
        return (f"{self.model_config.name}|{os.path.abspath(src)}|{stamp}|{self.runner.dtype}"
                f"|{self.runner.model.quantization}|kv:{self.runner.kv_dtype}")

    def _open_disk_cache(self) -> DiskKVCache | None:
        if not (self.config.enable_prefix_caching and self.config.disk_cache_dir):
            return None
        return DiskKVCache(self.config.disk_cache_dir, self.config.disk_cache_bytes,
                           self.runner.block_shape, self.runner.kv_dtype)

    def close(self) -> None:
        """Write every cached block to the disk tier and wait for the writes, so a restart
        starts warm. The engine stays usable."""
        if self.disk_cache is not None:
            self.runner.apply_kv_transfers(self.kv.persist_all())
            self.disk_cache.flush()

    @classmethod
    def from_model_path(cls, path: str | None = None,
                        config: EngineConfig = EngineConfig()) -> LLMEngine:
        check_device(config.device)  # before the load's seconds, not after them
        keep_mtp = SpecConfig.parse(config.spec).method == "mtp"  # its layers' tensors
        return cls(load_checkpoint(path, keep_mtp=keep_mtp), config)

    # ---- requests ---------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def validate(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None) -> None:
        """Raise a typed error if the request is invalid; changes nothing."""
        validate_request(request_id, prompt_token_ids, params, priority, cache_salt,
                         vocab_size=self.model_config.vocab_size,
                         max_model_len=self.max_model_len,
                         kv_capacity_tokens=self.kv_capacity_tokens)
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine",
                                        param="request_id")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams = SamplingParams(), priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        self.validate(request_id, prompt_token_ids, params, priority, cache_salt)
        request = Request(request_id, list(prompt_token_ids), params, priority,
                          arrival_time if arrival_time is not None else time.monotonic(),
                          cache_salt)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, stop=params.stop)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has nothing before it
        self.structured.attach(request)  # its grammar compiles in the background
        request.think = think_budget(params, request.prompt_token_ids, self.tokenizer)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; returns its final output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.structured.forget(request_id)
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._count_finished(request)
        return request_output(request, [], "", None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Plan, run and process one step. When overlapping (runtime/execution/overlap.py) the step
        is launched first and the previous one processed while it runs: outputs then come one
        step after the one that sampled them."""
        start = time.perf_counter()
        outputs = [self._refuse(r, error) for r, error in self.structured.poll()]
        overlap = self._may_overlap()
        if self.inflight is not None and not overlap:
            outputs += self._read_back(self.inflight)  # in order from here: catch up first
            self.inflight = None
        sched = self.scheduler.schedule()
        if sched.is_empty and self.structured.pending:
            self.structured.wait(GRAMMAR_WAIT_S)  # only compiles are left: do not spin
        self.threads.before_step()
        previous = self.inflight
        if overlap:
            outputs += self._launch(sched)
        else:
            outputs += self._postprocess(sched, self.runner.run(sched, self.requests))
        self.threads.after_step(sched.num_scheduled_tokens)
        seconds = time.perf_counter() - start
        # the inter-token budget learns step costs; an overlapped call waits for the step it
        # reads back, so its time is that step's
        timed = previous.sched if overlap and previous is not None else sched
        if not sched.is_empty:
            self.scheduler.observe_step(timed, seconds)
            if self.spec.enabled:  # the speculation governor prices decode steps by shape
                self.scheduler.governor.observe_step(timed, seconds)
        return outputs, self._stats(sched, seconds)

    def _may_overlap(self) -> bool:
        """Overlap this step unless a request needs its last token on the host to plan it."""
        if not self.overlap:
            return False
        speculating = self.spec.enabled
        return not any(needs_ordered_steps(r, speculating) for r in self.requests.values())

    def _launch(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Launch the step over the previous one's placeholders, advance the counters the
        next plan builds on, then process the previous step while this one runs."""
        previous = self.inflight
        pending = self.runner.launch(sched, self.requests,
                                     previous.pending if previous is not None else None)
        for request in self.scheduler.update_computed(sched):
            request.num_placeholders += 1  # its token is on the device until read back
        self.inflight = InFlight(sched, pending) if not sched.is_empty else None
        if previous is not None:
            self.counters.overlapped_steps += not sched.is_empty
            return self._read_back(previous)
        return []

    def _read_back(self, inflight: InFlight) -> list[RequestOutput]:
        """Process a launched step: its placeholders become tokens. Rows of requests that
        ended (or were parked) since it was planned are dropped: that work is wasted."""
        result = inflight.pending.result()
        sampled = []
        for s in inflight.sched.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.is_finished:
                continue
            if s.samples:
                request.num_placeholders -= 1
                if request.status is not RequestStatus.PARKED:
                    sampled.append(request)
            if request.status is RequestStatus.RUNNING:
                self.kv.cache_full_blocks(request)  # blocks whose tokens are known now
        return self._emit(inflight.sched, sampled, result)

    def _refuse(self, request: Request, error: GrammarError) -> RequestOutput:
        """End a request whose grammar failed to compile after admission, or failed within
        its limits mid-output: a refusal."""
        self.scheduler.finish_request(request, RequestStatus.FINISHED_REJECTED)
        self.requests.pop(request.request_id, None)
        return request_output(request, [], "", None, error={
            "message": str(error), "param": error.param, "kind": type(error).__name__})

    def _postprocess(self, sched: SchedulerOutput, result: StepSample) -> list[RequestOutput]:
        """Advance the requests, append their sampled tokens, stream and finish them."""
        sampled = self.scheduler.update_computed(sched, result.rejected)
        return self._emit(sched, sampled, result)

    def _emit(self, sched: SchedulerOutput, sampled: list[Request], result: StepSample
              ) -> list[RequestOutput]:
        """Append the tokens of the requests that sampled, stream them, finish those done."""
        for rid, (first, entries) in result.prompt_logprobs.items():
            if rid in self.requests:  # else it ended while its step ran
                self.requests[rid].add_prompt_logprobs(first, entries)
        count_spec(self.counters, sched, result)
        outputs = []
        now = time.monotonic()
        for request in sampled:
            tokens, text, finish = self._append(request, result.tokens[request.request_id])
            if request.grammar is not None and request.grammar.is_error:
                # past a parser limit mid-output: refused (a Rejected frame, nothing billed)
                # like a grammar that did not compile, never "finished" with partial text
                outputs.append(self._refuse(request, self.structured.broken(request)))
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            if finish is not None:
                if not request.detokenizer.stopped:
                    text += request.detokenizer.flush()  # text held back for stop strings
                self.scheduler.finish_request(request, finish)
                self.requests.pop(request.request_id, None)
                self._count_finished(request)
            outputs.append(request_output(request, tokens, text,
                                        result.logprobs.get(request.request_id),
                                        request.take_prompt_logprobs()))  # the first only
            self.counters.num_generation_tokens += len(tokens)
        return outputs

    def _append(self, request: Request, new: list[int]
                ) -> tuple[list[int], str, RequestStatus | None]:
        """Append a step's tokens, then any the grammar forces (jump-forward: their KV is
        computed next step, like a prompt chunk) or a spent reasoning budget forces (its end
        marker, runtime/structured/reasoning.py), checking stops after each one."""
        tokens, text, finish = [], "", None
        think = request.think
        if think is not None and think.exhausted and len(new) == 1 and \
                not (request.params.logprobs or request.params.top_logprobs):
            # a budget of 0 in a block the prompt opened: the end marker instead of the first
            # token (whose KV no step computed yet; its logprobs would be the sampled one's)
            new = think.forced_tokens(self._room(request)) or new
        while new and finish is None:
            for token in new:
                request.output_token_ids.append(token)
                tokens.append(token)
                text += request.detokenizer.push([token])
                waits = grammar_waits(request)  # a thought's tokens (and its end) are not
                if think is not None:  # the grammar's: it holds from the answer on
                    think.accept(token)
                if request.grammar is not None and not waits:
                    request.grammar.accept(token)
                finish = finish_status(request, token, self.eos_token_ids, self.max_model_len)
                if finish is not None:
                    break  # later accepted proposals or forced tokens go with the request
            new = [] if finish or grammar_waits(request) else \
                self.structured.jump_forward(request, self.max_model_len)
            if not new and finish is None and think is not None:
                new = think.forced_tokens(self._room(request))
        return tokens, text, finish

    def _room(self, request: Request) -> int:
        """Output tokens the request may still append (max_tokens, the context)."""
        return min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)

    def _count_finished(self, request: Request) -> None:
        self.counters.num_preemptions += request.num_preemptions

    def _stats(self, sched: SchedulerOutput, seconds: float) -> StepStats:
        decode = sum(s.num_new_tokens for s in sched.scheduled
                     if s.num_new_tokens - s.num_spec == 1)
        prefill = sched.num_scheduled_tokens - decode
        self.counters.num_steps += 1
        self.counters.num_prompt_tokens += prefill
        self.counters.seconds_busy += seconds
        return StepStats(len(sched.scheduled), prefill, decode, seconds,
                         self.kv.pool.num_used_blocks, self.kv.pool.num_blocks,
                         self.scheduler.num_running, self.scheduler.num_waiting,
                         len(sched.preempted_request_ids))

    # ---- prefill/decode disaggregation (runtime/transport/disagg.py moves the blocks) -------
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
        return timing(self.requests[request_id])

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
        request.think = think_budget(params, request.prompt_token_ids, self.tokenizer)
        for token in output_token_ids if request.think is not None else ():
            request.think.accept(token)
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

    # ---- descriptions for a worker's peers ---------------------------------------------
    def info(self) -> dict:
        """What a gateway needs to know about this engine (plain data)."""
        return {"model": self.model_config.name, "max_model_len": self.max_model_len,
                "vocab_size": self.model_config.vocab_size, "num_blocks": self.runner.num_blocks,
                "block_size": self.config.block_size, "max_num_seqs": self.config.max_num_seqs,
                "device": str(self.runner.device), "quantization": self.runner.model.quantization,
                "model_id": self.model_id,
                "eos_token_ids": list(self.model_config.eos_token_ids)}

    def snapshot(self) -> dict:
        """Gauges and counters now (plain data)."""
        kv, c = self.kv, self.counters
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "kv_blocks_used": kv.pool.num_used_blocks, "kv_blocks_total": kv.pool.num_blocks,
                "prefix_queries": kv.stats.queries, "prefix_hits": kv.stats.hits,
                "prefix_evictions": kv.stats.evictions, "steps": c.num_steps,
                "busy_seconds": c.seconds_busy, "preemptions": c.num_preemptions,
                "prompt_tokens": c.num_prompt_tokens, "generation_tokens": c.num_generation_tokens,
                "spec_drafts": c.spec_drafts, "spec_draft_tokens": c.spec_draft_tokens,
                "spec_accepted_tokens": c.spec_accepted_tokens,
                "spec_accepted_per_pos": list(c.spec_accepted_per_pos),
                "overlapped_steps": c.overlapped_steps, **self._expert_load()}

    def _expert_load(self) -> dict:
        """A mixture of experts' tokens routed to each expert since start, per layer
        ([layers][experts], dense layers' rows 0: runtime/models/moe.py); {} when dense."""
        load = getattr(self.runner.model, "expert_load", None)
        return {} if load is None else {"expert_tokens": load.total().tolist()}

    def drain_kv_events(self) -> KvEvents | None:
        """Cached blocks stored and removed since the last call, or None (runtime/kv/events.py)."""
        return self.kv.cached.events.drain()

    def kv_snapshot(self) -> KvEvents:
        """Every cached block held now, as a frame that replaces a gateway's view."""
        return self.kv.cached.events.snapshot()

    # ---- conveniences -----------------------------------------------------------------
    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits [n, vocab] at every prompt position, computed in one pass through the paged
        cache; the blocks are returned before this returns. Fails if other requests are busy."""
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logits needs an idle engine")
        self.validate("_logits", prompt_token_ids, SamplingParams(max_tokens=1))
        request = Request("_logits", list(prompt_token_ids), SamplingParams(max_tokens=1))
        if not self.kv.allocate_slots(request, request.num_tokens):
            raise MemoryError("the prompt does not fit in the KV cache")
        try:
            whole = ScheduledRequest(request.request_id, 0, tuple(request.prompt_token_ids),
                                     tuple(self.kv.block_ids(request.request_id)))
            sched = SchedulerOutput((whole,), kv_transfers=self.kv.take_transfers())
            return self.runner.all_logits(sched)
        finally:
            self.kv.remove(request.request_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); return output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            outputs, _ = self.step()
            for o in outputs:
                if o.request_id in results:
                    results[o.request_id].extend(o.new_token_ids)
        return [results[rid] for rid in ids]
