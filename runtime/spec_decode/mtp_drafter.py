"""`--spec mtp[:K]`: drafts from the checkpoint's multi-token-prediction module
(runtime/models/mtp.py), verified by the target in one pass like every proposer.

The module's row at position i needs the target's hidden state h_i (before its final norm)
and the token t_{i+1} that follows. Both are known once the target's step has run and sampled
(a prefill chunk's next token is the prompt's; a sampling request's is what it sampled; a
speculating request's rows stop at its last accepted proposal, the next token being the one
verification drew). So after each target step the runner hands the step's hidden states here
(`observe`) and the module writes the rows of every position the target computed, for every
request that may speculate, in one batched pass: its cache keeps pace with the target's
exactly (preemption and rejected proposals are overwritten by the positions recomputed), and
no hidden state is kept beyond the step but the module's own output at each request's last
row. That output is the first draft of the request's next step: `propose` runs the head on it,
then, for K > 1, the module again on its own output at the next positions (rows the next
`observe` overwrites with the true tokens where they are accepted; rows past those are never
read before they are written again).

The module's KV cache is its own tensor laid out on the target's block tables (slot = block *
block_size + offset, like a draft model's): one layer's rows, not a layer more in the pool, so
the pool's block shape, the disk tier's and PD's block format and `--kv-cache-gb`'s token count
stay the target's. Blocks reused by a prefix-cache hit still hold the rows written when they
were computed (the row at a hit's last position was made with the token that followed it then:
a draft quality matter only). A block loaded from the disk tier or another worker brings no
MTP rows: drafts over them are poorer, outputs are exact all the same (verification).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from contract.outputs import StepSample
from runtime.kv.cache_format import cache_shape
from runtime.loading.calibration import Calibration, resolve_cache_dir
from runtime.models.mtp import MTPModule, missing_mtp_tensors
from runtime.models.weights import LinearMaker
from runtime.scheduling.output import ScheduledRequest, SchedulerOutput
from runtime.spec_decode.governor import never_speculates

if TYPE_CHECKING:
    from runtime.scheduling.request import Request

log = logging.getLogger("runtime.startup")


class MTPDrafter:
    follows_target = True  # the runner calls `observe` after each target step

    def __init__(self, runner, weights: Mapping[str, torch.Tensor] | None):
        cfg = runner.model_cfg
        missing = missing_mtp_tensors(cfg, weights or {})
        if missing:
            raise ValueError(
                f"--spec mtp: {cfg.name} has no multi-token-prediction layer (missing "
                f"{', '.join(missing[:2])}; DeepSeek-V3/R1 folders carry one as "
                "num_nextn_predict_layers, kept at load when --spec mtp is asked for)")
        self.runner = runner
        target = runner.model
        quantization = target.quantization
        calibration = Calibration(resolve_cache_dir(None)) if quantization != "none" else None
        linear = LinearMaker(quantization, runner.dtype, calibration,
                             runner.config.quant_max_rows, runner.device)
        assert weights is not None
        try:
            self.model = MTPModule(cfg, weights, target, linear)
        except KeyError as e:  # a decoder-layer tensor of the MTP layer is absent
            raise ValueError(f"--spec mtp: {cfg.name}'s multi-token-prediction layer lacks "
                             f"{e}") from e
        linear.set_crossovers()
        linear.calibration.save()
        self.k_cache, self.v_cache = self._allocate_cache()
        target.keep_prenorm = True  # the runner's forward keeps h before the final norm
        runner.graphs = None  # a replayed graph would not hand its hidden states over
        # request id -> (position of its last written row, the module's output there [H])
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        log.info("MTP drafter: layer %d, %d matrices as the target's forms%s, its own KV "
                 "cache of %d MiB", cfg.num_hidden_layers, len(linear.made),
                 "" if self.model.own_head else " (the target's embedding and head)",
                 self.k_cache.numel() * self.k_cache.element_size()
                 * (1 if self.k_cache is self.v_cache else 2) >> 20)

    def _allocate_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache on the target's slots (+ the padding page), K and V one tensor
        for latent attention."""
        from runtime.execution.runner import lazily_zeroed

        r, c = self.runner, self.runner.model_cfg
        shape = cache_shape(c, (r.num_blocks + 1) * r.block_size, r.kv_dtype)
        tensors = []
        for _ in range(c.kv_tensors):
            tensors.append(lazily_zeroed(shape, r.kv_dtype) if r.device.type == "cpu" else
                           torch.zeros(shape, dtype=r.kv_dtype, device=r.device))
        return tensors[0], tensors[-1]

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._last.pop(rid, None)

    # ---- after the target's step --------------------------------------------------------
    @torch.inference_mode()
    def observe(self, batch: Sequence[ScheduledRequest], requests: Mapping[str, Request],
                hidden: torch.Tensor | None, last_index: Mapping[str, int],
                result: StepSample) -> None:
        """Write the module's rows for every position the target computed this step (its
        hidden states `hidden`, before the final norm, rows as `last_index` places them);
        keep each request's output at its last row, its next step's first draft."""
        if hidden is None:
            return
        rows: list[ScheduledRequest] = []
        sources: list[int] = []
        for s in batch:
            r = requests.get(s.request_id)
            if r is None or never_speculates(r.params):
                continue
            tokens = s.token_ids
            if s.samples:  # proposals accepted, then the token the step drew
                following = tuple(result.tokens.get(s.request_id, ()))
            else:  # a chunk: the next token is the sequence's own
                end = s.start_position + len(tokens)
                following = tuple(r.token_slice(end, end + 1))
            nxt = tokens[1:] + following
            valid = min(len(nxt), len(tokens) + s.num_spec)
            if valid <= 0:
                continue
            first = last_index[s.request_id] - (s.num_new_tokens - 1)
            rows.append(ScheduledRequest(s.request_id, s.start_position, nxt[:valid],
                                         s.block_ids))
            sources.extend(range(first, first + valid))
        if not rows:
            return
        input_ids, meta, index = self.runner.prepare(rows, self.model.cfg)
        order = torch.empty(len(sources), dtype=torch.long)
        at = 0
        for s in rows:
            n = len(s.token_ids)
            order[at:at + n] = torch.arange(index[s.request_id] - n + 1, index[s.request_id] + 1)
            at += n
        packed = hidden.new_empty(len(sources), hidden.shape[1])
        packed[order.to(hidden.device)] = hidden[torch.tensor(sources, device=hidden.device)]
        g = self.model.forward(input_ids, packed, meta, self.k_cache, self.v_cache)
        for s in rows:
            self._last[s.request_id] = (s.start_position + len(s.token_ids) - 1,
                                        g[index[s.request_id]].clone())

    # ---- before the target's step -------------------------------------------------------
    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, requests: Mapping[str, Request]
                ) -> dict[str, tuple[int, ...]]:
        """`num_spec` greedy drafts for every speculating request, by request id: the first
        from the module's output kept at the request's last row, the rest by running the
        module on its own output, one batched single-token pass per draft."""
        spec = [s for s in out.scheduled if s.num_spec]
        if not spec:
            return {}
        drafts: dict[str, list[int]] = {s.request_id: [] for s in spec}
        known = [s for s in spec if self._last.get(s.request_id, (-1,))[0]
                 == s.start_position - 1]
        for s in spec:  # no row yet (KV imported from another worker): a guess to verify
            if s not in known:
                drafts[s.request_id] = [s.token_ids[-1]] * s.num_spec
        if not known:
            return {rid: tuple(tokens) for rid, tokens in drafts.items()}
        g = torch.stack([self._last[s.request_id][1] for s in known])
        self._draft_from(g, known, drafts)
        for j in range(1, max(s.num_spec for s in known)):
            active = [i for i, s in enumerate(known) if s.num_spec > j]
            batch = [ScheduledRequest(known[i].request_id, known[i].start_position - 1 + j,
                                      (drafts[known[i].request_id][j - 1],),
                                      known[i].block_ids) for i in active]
            input_ids, meta, _ = self.runner.prepare(batch, self.model.cfg)  # all decodes
            g = self.model.forward(input_ids, g[active], meta, self.k_cache, self.v_cache)
            self._draft_from(g, [known[i] for i in active], drafts)
            g = _spread(g, active, len(known))
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    def _draft_from(self, g: torch.Tensor, spec: list[ScheduledRequest],
                    drafts: dict[str, list[int]]) -> None:
        tokens = self.model.compute_logits(g).argmax(dim=-1).tolist()
        for s, token in zip(spec, tokens):
            drafts[s.request_id].append(token)


def _spread(g: torch.Tensor, active: list[int], n: int) -> torch.Tensor:
    """Rows of the active requests back at their places among n (the others' unused)."""
    if len(active) == n:
        return g
    out = g.new_zeros(n, g.shape[1])
    out[torch.tensor(active, device=g.device)] = g
    return out
