"""A step-level simulator of an expert-parallel deployment (DeepSeek-V3 on H800s by default):
per-GPU received tokens, imbalance and throughput, without and with the balancer.

Attention and the shared expert run data-parallel (each GPU its own `tokens_per_gpu`); each
MoE layer sends every token's k assignments to the GPUs holding the replicas that
runtime/ep/replica.py picks, under either placement: the load-blind one over the same slots
(`static_placement`) or the balancer's (`rebalance`), planned from one window of a routing
trace (runtime/ep/trace.py) and measured on the next. A sample of `sample_per_gpu` tokens per
GPU (at most the batch: never smoother than it) is routed and its counts scaled to the batch.

A layer's time on a GPU is its compute (attention, shared expert, the routed tokens it
received; runtime/ep/costs.py's roofline or per-token overrides) and its all-to-all: FP8
dispatch plus BF16 combine of hidden values, over InfiniBand once per (token, remote node)
(received spread over the node's GPUs) and over NVLink for every assignment it receives from
another GPU; with `overlap` (two micro-batches) the two hide each other (max), else they add.
Each layer waits for its slowest GPU; a step is the sum of its layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.ep import costs
from runtime.ep.placement import Placement, imbalance, rebalance, static_placement
from runtime.ep.replica import choose_replicas
from runtime.ep.trace import counts, hot_ratio, sample_routing, zipf_popularity


@dataclass(frozen=True)
class Deployment:
    phase: str  # "prefill" (tokens_per_gpu input tokens) or "decode" (requests per GPU)
    gpus: int
    redundant: int
    tokens_per_gpu: int
    context: float  # average context a computed token attends to
    mtp_accept: float = 0.0  # decode with MTP: 2 tokens a request a step, 1 + this accepted
    cache_hit: float = 0.0  # prefill: share of input tokens served by the prefix cache
    overlap: bool = True
    sample_per_gpu: int = 512
    history_per_gpu: int = 512  # tokens per GPU in the window the balancer plans from
    layers_simulated: int = 0  # MoE layers routed (0: all), the step scaled to all of them
    expert_s_per_token: float | None = None  # override the roofline: one assignment, one layer
    attn_s_per_token: float | None = None  # override the roofline: one token, one layer

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be prefill or decode, not {self.phase!r}")
        if self.gpus <= 0 or self.tokens_per_gpu <= 0 or self.sample_per_gpu <= 0:
            raise ValueError("gpus, tokens per GPU and the sample must be positive")
        if not 0.0 <= self.mtp_accept <= 1.0 or not 0.0 <= self.cache_hit < 1.0:
            raise ValueError("mtp_accept must be in [0, 1] and cache_hit in [0, 1)")


@dataclass
class Outcome:
    """One placement's figures (per step unless said)."""

    per_gpu: np.ndarray  # routed assignments each GPU receives, a layer on average
    imbalance: float  # max / mean received, averaged over layers
    step_s: float
    parts_s: dict[str, float] = field(default_factory=dict)  # slowest GPU's, summed over layers

    def tokens_per_s_gpu(self, dep: Deployment) -> float:
        """Prefill: input tokens computed; decode: output tokens (with MTP's accepted)."""
        done = dep.tokens_per_gpu * (1.0 + dep.mtp_accept if dep.phase == "decode" else 1.0)
        return done / self.step_s


@dataclass
class SimResult:
    deployment: Deployment
    hot_ratio: float  # measured on the planning window
    static: Outcome
    eplb: Outcome
    policy: str


def simulate(dep: Deployment, model: costs.ModelShape, hw: costs.Hardware, zipf_s: float,
             seed: int = 0) -> SimResult:
    gpn = min(hw.gpus_per_node, dep.gpus)
    if dep.gpus % gpn:
        raise ValueError(f"{dep.gpus} GPUs do not fill nodes of {gpn}")
    layers = dep.layers_simulated or model.moe_layers
    pop = zipf_popularity(layers, model.experts, zipf_s, seed)
    rows = dep.tokens_per_gpu * (2 if dep.phase == "decode" and dep.mtp_accept else 1)
    sample = min(dep.sample_per_gpu, rows)  # never smoother than the real batch
    t_hist, t_eval = dep.gpus * dep.history_per_gpu, dep.gpus * sample
    plan = np.stack([counts(_route(model, p, t_hist, seed + 1000 + i), model.experts)
                     for i, p in enumerate(pop)])
    placements = {"static": static_placement(plan, dep.gpus, dep.redundant),
                  "eplb": rebalance(plan, dep.gpus, dep.redundant, nodes=dep.gpus // gpn,
                                    groups=model.groups)}
    per_layer: dict[str, list] = {name: [] for name in placements}
    for i, p in enumerate(pop):
        ids = _route(model, p, t_eval, seed + 2000 + i)
        for name, placed in placements.items():
            per_layer[name].append(_layer(dep, model, hw, placed, i, ids, sample, rows, gpn))
    fixed, fixed_parts = _fixed_step(dep, model, hw, rows)
    out = {name: _outcome(per_layer[name], model.moe_layers / layers, fixed, fixed_parts)
           for name in placements}
    return SimResult(dep, hot_ratio(plan), out["static"], out["eplb"],
                     placements["eplb"].policy)


def _route(model: costs.ModelShape, pop: torch.Tensor, tokens: int, seed: int) -> torch.Tensor:
    return sample_routing(pop, tokens, model.k, model.groups, model.groups_kept, seed)


def _layer(dep: Deployment, model: costs.ModelShape, hw: costs.Hardware, placed: Placement,
           layer: int, ids: torch.Tensor, sample: int, rows: int, gpn: int) -> dict:
    """One MoE layer under one placement: received per GPU, and its parts' seconds on the
    slowest GPU."""
    l2p = torch.from_numpy(placed.logical_to_phys[layer])
    reps = torch.from_numpy(placed.replicas[layer])
    gpu = choose_replicas(ids, l2p, reps, offset=layer) // placed.slots_per_worker  # [T, k]
    src = torch.arange(ids.shape[0]) // sample  # token t lives on GPU t // sample
    scale = rows / sample
    recv = torch.bincount(gpu.reshape(-1), minlength=dep.gpus).double() * scale
    remote = gpu != src[:, None]
    from_others = torch.bincount(gpu[remote], minlength=dep.gpus).double() * scale
    # InfiniBand: one copy per (token, remote node), received spread over that node's GPUs
    nodes = dep.gpus // gpn
    dest_node = torch.zeros(ids.shape[0], nodes, dtype=torch.bool)
    dest_node.scatter_(1, gpu // gpn, True)
    dest_node[torch.arange(ids.shape[0]), src // gpn] = False
    ib_sent = torch.bincount(src, weights=dest_node.sum(1).double(), minlength=dep.gpus) * scale
    ib_recv = (dest_node.sum(0).double() * scale / gpn).repeat_interleave(gpn)
    token_bytes = model.hidden * (1.0 + 1.0 / 32 + 2.0)  # FP8 + scales out, BF16 back
    comm = torch.maximum(torch.maximum(ib_sent, ib_recv) * token_bytes / (hw.ib_gbs * 1e9),
                         from_others * token_bytes / (hw.nvlink_gbs * 1e9))
    attn = _attention_s(dep, model, hw, rows)
    shared = _expert_s(dep, model, hw, rows * model.shared, model.shared)
    routed = torch.tensor([_expert_s(dep, model, hw, float(r), placed.slots_per_worker)
                           for r in recv.tolist()], dtype=torch.float64)
    compute = attn + shared + routed
    total = torch.maximum(compute, comm) if dep.overlap else compute + comm
    g = int(torch.argmax(total))
    return {"recv": recv.numpy(), "time": float(total[g]), "attention": attn,
            "shared expert": shared, "routed experts": float(routed[g]),
            "all-to-all": float(comm[g])}


def _attention_s(dep: Deployment, model: costs.ModelShape, hw: costs.Hardware, rows: int
                 ) -> float:
    if dep.attn_s_per_token is not None:
        return rows * dep.attn_s_per_token
    decode = dep.phase == "decode"
    proj, core = costs.attention_flops(model, dep.context, decode)
    read = costs.attention_weight_bytes(model)
    if decode:  # every request's latent cache, once per step
        read += dep.tokens_per_gpu * dep.context * costs.kv_bytes_per_context_token(model)
    return hw.seconds(rows * proj, read, rows * core)


def _expert_s(dep: Deployment, model: costs.ModelShape, hw: costs.Hardware, assignments: float,
              held: int) -> float:
    """`assignments` tokens through the `held` experts one GPU holds in one layer."""
    if dep.expert_s_per_token is not None:
        return assignments * dep.expert_s_per_token
    return hw.seconds(assignments * costs.expert_flops(model), held * costs.expert_bytes(model))


def _fixed_step(dep: Deployment, model: costs.ModelShape, hw: costs.Hardware, rows: int
                ) -> tuple[float, dict[str, float]]:
    """The dense layers (attention and a dense MLP, no all-to-all) and, in decode, the
    output head (BF16): the same on every GPU."""
    dense = model.layers - model.moe_layers
    mlp = 6.0 * model.hidden * model.dense_intermediate
    parts = {"dense layers": dense * (_attention_s(dep, model, hw, rows)
                                      + hw.seconds(rows * mlp, mlp / 2))}
    if dep.phase == "decode":
        head = 2.0 * model.hidden * model.vocab
        parts["output head"] = hw.seconds(0.0, head, rows * head)
    return sum(parts.values()), parts


def _outcome(layers: list[dict], weight: float, fixed: float, fixed_parts: dict[str, float]
             ) -> Outcome:
    recv = np.stack([layer["recv"] for layer in layers])
    parts = {key: weight * sum(layer[key] for layer in layers)
             for key in ("attention", "shared expert", "routed experts", "all-to-all")}
    parts.update(fixed_parts)
    step = weight * sum(layer["time"] for layer in layers) + fixed
    return Outcome(recv.mean(axis=0), float(imbalance(recv).mean()), step, parts)
