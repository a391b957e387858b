"""Batched next-token sampling: penalties, greedy or temperature/top-k/top-p/min-p, logprobs;
and the scoring of given tokens (prompt logprobs).

Each row is processed as: grammar mask -> penalties -> (greedy: argmax) | (temperature -> top-k
-> top-p -> min-p -> draw). Every filter is a cutoff on the row's own probabilities and an exact
no-op for a row that does not use it, so a row's result never depends on which other rows share
the batch.
Sampling uses the exponential race, argmax(probs / q) with q = -log(U) ~ Exp(1) per token, which
picks token i with probability probs[i] / sum(probs) (no renormalisation needed after masking)
and consumes exactly one length-V uniform vector per sampled row per step. A structured-output
row's grammar mask sets its refused tokens to -inf first, so its logprobs and every filter see
the masked distribution; unmasked rows keep their exact values.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from contract.outputs import MIN_LOGPROB, PromptLogprob
from contract.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.structured.masks import TokenMask


@dataclass
class SamplingRow:
    """One request's view for this step."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator if seeded, else None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties read these)


@dataclass
class SampleResult:
    token_ids: list[int]
    # log-prob of the chosen token under log_softmax of the logits before penalties and
    # filters (after a grammar's mask); None if not asked
    logprobs: list[float | None]
    # top-N (id, logprob) under the same distribution, best first (fewer where a mask leaves
    # fewer tokens possible); None if not asked
    top_logprobs: list[list[tuple[int, float]] | None]


def _wants_logprobs(p: SamplingParams) -> bool:
    # top_logprobs alone also needs the chosen token's logprob (the engine keys on it)
    return p.logprobs or p.top_logprobs > 0


def _column(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] occurrence counts; lists are padded with an extra column that is dropped."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    ids = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return penalised logits [n, V] (out of place).

    repetition (HF convention): a logit of a token seen in prompt or output is divided by the
    penalty if positive, multiplied if negative. presence/frequency (OpenAI convention):
    subtract presence * [count > 0] + frequency * count over output tokens only.
    """
    vocab, device = logits.shape[1], logits.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    prompt_counts = _token_counts([r.prompt_token_ids for r in rows], vocab, device)
    rep = _column([r.params.repetition_penalty for r in rows], device)
    seen = (out_counts > 0) | (prompt_counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    presence = _column([r.params.presence_penalty for r in rows], device)
    frequency = _column([r.params.frequency_penalty for r in rows], device)
    return logits - presence * (out_counts > 0).float() - frequency * out_counts


def _top_k_top_p_threshold(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, 1] probability cutoff: tokens at or above it survive top-k, then top-p.

    top-p applies to the top-k-renormalised mass and keeps the minimal nucleus. Working with a
    cutoff value rather than kept ranks keeps all tokens tied at the boundary, so the result
    never depends on how a sort orders ties (nor on which path the batch took).
    """
    vocab, device = probs.shape[1], probs.device
    k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                     device=device).unsqueeze(1)
    if all(p.top_p >= 1.0 for p in params):
        # top-k only: a partial top-k beats a full sort over the vocabulary
        enabled = [p.top_k > 0 for p in params]
        values = probs.topk(int(k[torch.tensor(enabled)].max()), dim=-1).values
        cutoff = values.gather(1, k.clamp(max=values.shape[1]) - 1)
        return cutoff.masked_fill(~torch.tensor(enabled, device=device).unsqueeze(1), 0.0)
    values = probs.sort(dim=-1, descending=True).values
    cumulative = values.cumsum(dim=-1)
    # a token is inside the nucleus while the mass strictly before it is below top_p of the
    # top-k mass; rank 0 has none before it, so at least one token survives. A disabled top-p
    # gets an infinite bound so rounding in the cumsum can never drop the tail.
    top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
    inside = (cumulative - values) < top_p * cumulative.gather(1, k - 1)
    last_rank = torch.minimum(k, inside.sum(dim=-1, keepdim=True)) - 1
    return values.gather(1, last_rank)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled probabilities [n, V] with top-k/top-p/min-p losers set to zero.

    Not renormalised: the exponential race is scale-invariant, and so is min-p's ratio test.
    """
    temperature = _column([p.temperature for p in params], logits.device)
    probs = torch.softmax(logits / temperature, dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs = probs.masked_fill(probs < _top_k_top_p_threshold(probs, params), 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], logits.device)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


class Sampler:
    """Turns a step's logits into one token per row, reproducibly for seeded rows."""

    def __init__(self, device: str | torch.device = "cpu", seed: int = 0):
        self.device = torch.device(device)
        # engine-level randomness for rows without a seed of their own
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 mask: TokenMask | None = None) -> SampleResult:
        return self.sample(logits, rows, mask).result()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               mask: TokenMask | None = None) -> DeviceSample:
        """The step's tokens left on the device, their copy to the host started."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        raw = logits.float()  # bf16 -> f32; f32 is not copied, so nothing below writes in place
        if mask is not None:
            raw = mask.apply(raw)  # out of place, the constrained rows in one op
        logits = self._penalised(raw, rows)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            tokens = self._sample_rows(logits, rows, sampled, tokens)
        return self._result(raw, rows, tokens)

    # ---- penalties ------------------------------------------------------------------------
    def _penalised(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        which = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if not which:
            return logits
        idx = torch.tensor(which, device=logits.device)
        sub = apply_penalties(logits.index_select(0, idx), [rows[i] for i in which])
        return logits.index_copy(0, idx, sub)

    # ---- sampling -------------------------------------------------------------------------
    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow], sampled: list[int],
                     tokens: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(sampled, device=logits.device)
        probs = filtered_probs(logits.index_select(0, idx), [rows[i].params for i in sampled])
        noise = self._exponential_noise(probs.shape, [rows[i].generator for i in sampled],
                                        probs.device)
        return tokens.index_copy(0, idx, (probs / noise).argmax(dim=-1))

    def _exponential_noise(self, shape: torch.Size, generators: list[torch.Generator | None],
                           device: torch.device) -> torch.Tensor:
        """One Exp(1) vector per row; a seeded row draws only from its own generator."""
        uniform = torch.empty(shape, dtype=torch.float32, device=device)
        shared = [j for j, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            uniform.uniform_(generator=self.generator)
        elif shared:
            idx = torch.tensor(shared, device=device)
            draw = torch.empty(len(shared), shape[1], dtype=torch.float32, device=device)
            uniform.index_copy_(0, idx, draw.uniform_(generator=self.generator))
        for j, g in enumerate(generators):
            if g is not None:
                uniform[j].uniform_(generator=g)
        # -log(U) rather than exponential_(): same law, 2-3x cheaper on the CPU. U < 1 keeps q
        # above 0; clamping U away from 0 keeps q finite, so a kept token always outscores a
        # masked one (0 / q), even when it is the only one left.
        return uniform.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()

    # ---- logprobs ---------------------------------------------------------------------
    def _result(self, raw: torch.Tensor, rows: list[SamplingRow],
                tokens: torch.Tensor) -> DeviceSample:
        """The tokens and asked-for logprobs, still on the device (nothing here syncs)."""
        wanted = [i for i, r in enumerate(rows) if _wants_logprobs(r.params)]
        if not wanted:
            return DeviceSample(tokens, rows)
        idx = torch.tensor(wanted, device=raw.device)
        lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
        n_top = max(rows[i].params.top_logprobs for i in wanted)
        top = lp.topk(min(n_top, lp.shape[1]), dim=-1) if n_top > 0 else None
        return DeviceSample(tokens, rows, wanted, chosen, top)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start `t`'s copy to the host (pinned, non-blocking on CUDA): read once it is done."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class DeviceSample:
    """A step's sampled tokens (and logprobs) on the device, with their copy to the host
    started: the next step can read `tokens` on the device before the host does
    (runtime/execution/overlap.py). `result()` waits for the copy and formats a SampleResult."""

    def __init__(self, tokens: torch.Tensor, rows: list[SamplingRow],
                 wanted: Sequence[int] = (), chosen: torch.Tensor | None = None, top=None):
        self.tokens = tokens  # [n] int64, on the device
        self._n_top = [rows[i].params.top_logprobs for i in wanted]
        self._num_rows, self._wanted = len(rows), list(wanted)
        self._host = [_to_host(t) for t in (tokens, chosen, *(top or (None, None)))]
        self._done = None
        if tokens.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> SampleResult:
        if self._done is not None:
            self._done.synchronize()  # this step's copies only, not everything queued since
        tokens, chosen, top_vals, top_ids = self._host
        token_ids = tokens.tolist()
        logprobs: list[float | None] = [None] * self._num_rows
        top: list[list[tuple[int, float]] | None] = [None] * self._num_rows
        if not self._wanted:
            return SampleResult(token_ids, logprobs, top)
        chosen_values = chosen.tolist()
        values = top_vals.tolist() if top_vals is not None else []
        ids = top_ids.tolist() if top_ids is not None else []
        for j, (i, n) in enumerate(zip(self._wanted, self._n_top)):
            logprobs[i] = chosen_values[j]
            if n > 0:  # tokens a grammar's mask rules out (-inf) are no alternatives
                top[i] = [(t, v) for t, v in zip(ids[j][:n], values[j][:n])
                          if v != float("-inf")]
        return SampleResult(token_ids, logprobs, top)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[PromptLogprob]:
    """Score row i's given token `targets[i]` under log_softmax of the raw logits in float32:
    its logprob, its rank (1 + the tokens strictly more likely) and the k most likely
    (id, logprob), best first. Values below MIN_LOGPROB (-inf) are reported at the floor."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    values = chosen.squeeze(1).clamp_min(MIN_LOGPROB).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in values]
    if k > 0:
        top_vals, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        top = [list(zip(ids, vals)) for ids, vals in
               zip(top_ids.tolist(), top_vals.clamp_min(MIN_LOGPROB).tolist())]
    return [PromptLogprob(t, v, r, tuple(alt))
            for t, v, r, alt in zip(targets.tolist(), values, ranks, top)]
