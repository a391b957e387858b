"""What a step reports for a request: whether the token just appended ends it, the
`RequestOutput` it streams (usage, and timing once finished), and vLLM's speculation counters.
Plain functions over the request record: no engine state, no tensors."""
from __future__ import annotations

import time

from contract.outputs import EngineCounters, RequestOutput, StepSample, Usage, wall_clock
from runtime.scheduling.output import SchedulerOutput
from runtime.scheduling.request import Request, RequestStatus


def finish_status(request: Request, token: int, eos_token_ids: frozenset[int],
                  max_model_len: int) -> RequestStatus | None:
    """The status `token` (just appended) ends the request with, or None if it goes on."""
    params, grammar = request.params, request.grammar
    if grammar is not None and grammar.is_error:
        request.stop_reason = grammar.error[:200]
        return RequestStatus.FINISHED_ERROR
    # a grammar allows the end only where it is complete, and then it ends the output
    is_eos = (not params.ignore_eos or grammar is not None) and token in eos_token_ids
    if token in params.stop_token_set or is_eos:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if request.detokenizer.stopped:
        request.stop_reason = request.detokenizer.stop_reason
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or \
            request.num_known_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def timing(request: Request) -> dict:
    """When the request arrived, was first scheduled and sampled its first token (wall clock)."""
    return {"arrival": wall_clock(request.arrival_time),
            "scheduled": wall_clock(request.first_scheduled_time),
            "first_token": wall_clock(request.first_token_time)}


def request_output(request: Request, tokens: list[int], text: str, logprobs,
                   prompt_logprobs=None, error: dict | None = None) -> RequestOutput:
    """One step's delta of a request; a finished one carries its timing and stop reason."""
    usage = Usage(request.num_prompt_tokens, request.num_cached_tokens,
                  request.num_output_tokens)
    finished = request.is_finished
    return RequestOutput(request.request_id, tokens, text, finished,
                         request.status.value if finished else None, usage, logprobs,
                         request.stop_reason if finished else None,
                         _final_timing(request) if finished else None, prompt_logprobs, error)


def _final_timing(request: Request) -> dict:
    final = timing(request) | {"finished": time.time(), "preemptions": request.num_preemptions}
    spec = request.spec
    if spec.num_proposed:
        final["spec_acceptance"] = spec.num_accepted / spec.num_proposed
        final["spec_proposed"] = spec.num_proposed
    if request.grammar is not None:
        final["forced_tokens"] = request.grammar.num_forced
    return final


def count_spec(counters: EngineCounters, sched: SchedulerOutput, result: StepSample) -> None:
    """vLLM's counters: drafts, draft tokens, accepted tokens (also per position)."""
    c = counters
    for s in sched.scheduled:
        if s.num_spec:
            accepted = s.num_spec - result.rejected.get(s.request_id, 0)
            c.spec_drafts += 1
            c.spec_draft_tokens += s.num_spec
            c.spec_accepted_tokens += accepted
            while len(c.spec_accepted_per_pos) < s.num_spec:
                c.spec_accepted_per_pos.append(0)
            for pos in range(accepted):
                c.spec_accepted_per_pos[pos] += 1
