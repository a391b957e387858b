"""A sparse mixture-of-experts block: the MLP of a MoE layer (Mixtral, Qwen2/3-MoE, DeepSeek).

Each token's k experts come from the layer's router (runtime/models/routing.py). The step's
tokens are then grouped by expert: the flattened (token, k) assignments sorted by expert id
(stable), the tokens' rows gathered once in that order, and each expert that received rows
runs its gate/up and down Linears once on its contiguous run of them; the outputs, multiplied
by their routing weights, are added back to their tokens with one `index_add_`. The loop is
over the experts that received tokens, never over tokens. Each expert's matrices are built
by the model's `LinearMaker` like a dense layer's, so they are served in the same form (float,
int8 per row with its crossover, or a file's blocks run by the C block kernels).

Shared experts (DeepSeek's `shared_experts`, Qwen2-MoE's `shared_expert`, the latter scaled
by `sigmoid(x . shared_expert_gate)`) run on every token and are added to the routed sum.

`ExpertLoad` counts the tokens routed to each expert, per layer (the expert balancer reads it).

Inside a CUDA graph capture the grouping cannot run (its run lengths are read on the host), so
a captured step runs every expert on every row, weighted by zero where it was not chosen: the
same result, sync-free; replayed steps are not counted in `ExpertLoad` (the warm-up run
before a capture is, padding rows included). Steps of a `self:L` draft model, which shares the
target's first layers, are counted with the target's.
"""
from __future__ import annotations

import torch

import kernels
from contract.config import ModelConfig
from runtime.models.linear import Linear
from runtime.models.routing import Router
from runtime.models.weights import LinearMaker, ModelWeights


class ExpertLoad:
    """Tokens routed to each expert: an int64 [layers, experts] count on the model's device
    (dense layers' rows stay 0). Each (token, expert) assignment counts once, so a step adds
    tokens * k to each MoE layer's row. Read `total()` (since start) or
    `snapshot_and_reset()` (since the last snapshot)."""

    def __init__(self, layers: int, experts: int, device: torch.device):
        self.counts = torch.zeros(layers, experts, dtype=torch.int64, device=device)
        self._before = torch.zeros(layers, experts, dtype=torch.int64)  # snapshots taken, CPU

    def add(self, layer: int, per_expert: torch.Tensor) -> None:
        self.counts[layer] += per_expert

    def snapshot_and_reset(self) -> torch.Tensor:
        """Counts since the last snapshot (a CPU copy); the counter restarts from zero."""
        now = self.counts.to("cpu", copy=True)
        self.counts.zero_()
        self._before += now
        return now

    def total(self) -> torch.Tensor:
        """Counts since the model was built (a CPU copy)."""
        return self._before + self.counts.cpu()


class SparseMoE:
    """One layer's experts: router, routed experts (each a gate/up and a down Linear), shared
    expert. `prefix` is the layer's `mlp.` prefix; the expert names are the Hub's (runtime/
    loading/hf.py renames Mixtral's and splits transformers' stacked tensors into these)."""

    def __init__(self, cfg: ModelConfig, w: ModelWeights, prefix: str, linear: LinearMaker,
                 layer: int, load: ExpertLoad | None):
        self.layer, self.load = layer, load
        self.num_experts, self.k = cfg.num_experts, cfg.experts_per_token
        bias = prefix + "gate.e_score_correction_bias"
        self.router = Router(cfg, _float32(w, prefix + "gate.weight"),
                             _float32(w, bias) if bias in w else None)
        e = prefix + "experts."
        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        for i in range(cfg.num_experts):
            self.gate_up.append(linear([w.matrix(f"{e}{i}.gate_proj.weight"),
                                        w.matrix(f"{e}{i}.up_proj.weight")]))
            self.down.append(linear([w.matrix(f"{e}{i}.down_proj.weight")]))
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            s = prefix + ("shared_experts." if (prefix + "shared_experts.down_proj.weight") in w
                          else "shared_expert.")
            self.shared_gate_up = linear([w.matrix(s + "gate_proj.weight"),
                                          w.matrix(s + "up_proj.weight")])
            self.shared_down = linear([w.matrix(s + "down_proj.weight")])
            if cfg.shared_expert_gated:
                self.shared_gate = w.tensor(prefix + "shared_expert_gate.weight")

    def linears(self) -> list[Linear]:
        shared = [self.shared_gate_up, self.shared_down] if self.shared_down else []
        return [lin for pair in zip(self.gate_up, self.down) for lin in pair] + shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (normalised); returns the block's output [T, hidden]."""
        weights, ids = self.router(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._every_expert(x, weights, ids)
        else:
            out = self.routed(x, weights, ids)
        if self.shared_down is not None:
            assert self.shared_gate_up is not None
            shared = self.shared_down(kernels.silu_and_mul(self.shared_gate_up(x)))
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(torch.nn.functional.linear(x, self.shared_gate))
            out = out + shared
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, tokens grouped by expert (see the module's text)."""
        flat = ids.reshape(-1)
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        if self.load is not None:
            self.load.add(self.layer, per_expert)
        order = torch.argsort(flat, stable=True)  # assignments by expert, tokens in order
        tokens = order // self.k
        rows = x[tokens]  # the one gather: each expert's rows are a contiguous run
        ys = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n:
                run = rows[start:start + n]
                ys[start:start + n] = self.down[e](kernels.silu_and_mul(self.gate_up[e](run)))
                start += n
        ys *= weights.reshape(-1)[order].to(ys.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                      ) -> torch.Tensor:
        """The same sum with no host read (a CUDA graph's capture): each expert on every row,
        weighted by 0 where the row did not choose it."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, ids, weights.to(x.dtype))
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            y = self.down[e](kernels.silu_and_mul(self.gate_up[e](x)))
            out += y * dense[:, e:e + 1]
        return out


def _float32(w: ModelWeights, name: str) -> torch.Tensor:
    """A router tensor in float32 on the model's device, whatever the model's dtype."""
    return w.weights[name].to(device=w.device, dtype=torch.float32)
