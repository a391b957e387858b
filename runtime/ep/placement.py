"""Expert placement for expert parallelism: which logical expert each physical slot of each
worker holds, per MoE layer, with R redundant slots given to the hottest experts.

The objective is the most-loaded worker's received tokens (each step waits for it). The design
follows DeepSeek's published EPLB (github.com/deepseek-ai/EPLB), in our own code:

- hierarchical policy (nodes divide the expert groups): pack whole expert groups onto nodes so
  that nodes carry equal tokens (group-limited routing then sends each token to few nodes,
  keeping traffic on the fast intra-node links), replicate the hottest experts within each
  node into its share of the redundant slots, then pack the node's replicas onto its workers;
- global policy (otherwise, e.g. decode's EP144): replicate over all slots regardless of
  groups and pack the replicas onto every worker.

Loads are each expert's tokens over a window (runtime/ep/load_window.py). A replica is
assumed to receive an equal share of its expert's tokens, which runtime/ep/replica.py's choice
delivers. `static_placement` is the load-blind baseline over the same slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from runtime.ep.packing import pack, replicate

Policy = Literal["auto", "hierarchical", "global"]


@dataclass(frozen=True)
class Placement:
    """One placement of every MoE layer's experts.

    phys_to_logical: int64 [layers, workers, slots]: the logical expert each slot holds.
    replicas: int64 [layers, experts]: how many slots hold each expert (>= 1).
    logical_to_phys: int64 [layers, experts, max replicas]: each expert's slots as flat ids
        (worker * slots + slot), in ascending order, padded with -1.
    expected_load: float64 [layers, workers]: tokens each worker receives for the loads the
        placement was made from, each expert's tokens split evenly over its replicas."""

    phys_to_logical: np.ndarray
    replicas: np.ndarray
    logical_to_phys: np.ndarray
    expected_load: np.ndarray
    policy: str

    @property
    def workers(self) -> int:
        return int(self.phys_to_logical.shape[1])

    @property
    def slots_per_worker(self) -> int:
        return int(self.phys_to_logical.shape[2])

    def worker_loads(self, loads: np.ndarray) -> np.ndarray:
        """float64 [layers, workers]: what each worker receives under other loads [layers,
        experts] (a later window), each expert's tokens split evenly over its replicas."""
        return worker_loads(self.phys_to_logical, self.replicas, _as_loads(loads))


def imbalance(per_worker: np.ndarray) -> np.ndarray:
    """Max over mean of each row (1.0 for a row without tokens)."""
    mean = per_worker.mean(axis=-1)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, per_worker.max(axis=-1) / safe, 1.0)


def worker_loads(phys_to_logical: np.ndarray, replicas: np.ndarray, loads: np.ndarray
                 ) -> np.ndarray:
    layers = np.arange(loads.shape[0])[:, None, None]
    share = loads / replicas  # each replica's even share of its expert's tokens
    return share[layers, phys_to_logical].sum(axis=-1)


def rebalance(loads: np.ndarray, workers: int, redundant: int, nodes: int = 1,
              groups: int = 1, policy: Policy = "auto") -> Placement:
    """A placement of loads [layers, experts] (tokens per expert, any numeric array) over
    `workers` workers in `nodes` equal nodes, with `redundant` extra slots in all;
    (experts + redundant) must split evenly over the workers. "auto" is hierarchical when
    there is more than one node and the nodes divide the groups, else global."""
    w = _as_loads(loads)
    layers, experts = w.shape
    slots = experts + redundant
    _check(experts, workers, redundant, nodes, groups)
    if policy == "auto":
        policy = "hierarchical" if nodes > 1 and groups % nodes == 0 else "global"
    if policy == "hierarchical" and groups % nodes:
        raise ValueError(f"the hierarchical policy needs the nodes ({nodes}) to divide the "
                         f"expert groups ({groups})")
    if policy == "global":
        nodes, groups = 1, 1
    if slots % nodes:
        raise ValueError(f"{slots} slots do not split evenly over {nodes} nodes")
    per_worker = slots // workers
    phys = np.empty((layers, workers, per_worker), dtype=np.int64)
    counts = np.empty((layers, experts), dtype=np.int64)
    for layer in range(layers):
        phys[layer], counts[layer] = _place_layer(w[layer], workers, slots, nodes, groups)
    return _finish(phys, counts, w, policy)


def static_placement(loads: np.ndarray, workers: int, redundant: int = 0) -> Placement:
    """The load-blind placement over the same slots: flat slot s holds expert s mod experts
    (contiguous experts per worker; the redundant slots repeat the first experts)."""
    w = _as_loads(loads)
    layers, experts = w.shape
    _check(experts, workers, redundant, 1, 1)
    flat = np.arange(experts + redundant) % experts
    phys = np.broadcast_to(flat.reshape(workers, -1), (layers, workers,
                                                       (experts + redundant) // workers))
    counts = np.stack([np.bincount(flat, minlength=experts)] * layers).astype(np.int64)
    return _finish(np.ascontiguousarray(phys), counts, w, "static")


def _check(experts: int, workers: int, redundant: int, nodes: int, groups: int) -> None:
    if experts <= 0 or workers <= 0 or nodes <= 0 or groups <= 0 or redundant < 0:
        raise ValueError("experts, workers, nodes and groups must be positive, redundant >= 0")
    if (experts + redundant) % workers:
        raise ValueError(f"{experts} experts + {redundant} redundant slots do not split "
                         f"evenly over {workers} workers")
    if workers % nodes:
        raise ValueError(f"{workers} workers do not split evenly over {nodes} nodes")
    if experts % groups:
        raise ValueError(f"{experts} experts do not split into {groups} equal groups")


def _place_layer(w: np.ndarray, workers: int, slots: int, nodes: int, groups: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One layer: (phys_to_logical [workers, slots per worker], replica counts [experts])."""
    experts = w.shape[0]
    group_size = experts // groups
    group_node = pack(w.reshape(groups, group_size).sum(axis=1), nodes)
    counts = np.empty(experts, dtype=np.int64)
    per_node_workers, per_worker = workers // nodes, slots // workers
    phys = np.empty((workers, per_worker), dtype=np.int64)
    for node in range(nodes):
        mine = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                               for g in np.flatnonzero(group_node == node)])
        counts[mine] = replicate(w[mine], slots // nodes)
        replica_of = np.repeat(mine, counts[mine])  # logical id of each of the node's replicas
        share = w[replica_of] / counts[replica_of]
        worker = pack(share, per_node_workers, keys=replica_of)
        for local in range(per_node_workers):
            held = replica_of[worker == local]
            phys[node * per_node_workers + local] = np.sort(held)
    return phys, counts


def _finish(phys: np.ndarray, counts: np.ndarray, w: np.ndarray, policy: str) -> Placement:
    layers, experts = counts.shape
    width = int(counts.max())
    l2p = np.full((layers, experts, width), -1, dtype=np.int64)
    flat = phys.reshape(layers, -1)
    for layer in range(layers):
        order = np.argsort(flat[layer], kind="stable")  # slots grouped by expert, ascending
        ids = flat[layer][order]
        rank = np.arange(len(ids)) - np.searchsorted(ids, ids)  # replica index within expert
        l2p[layer, ids, rank] = order
    return Placement(phys, counts, l2p, worker_loads(phys, counts, w), policy)


def _as_loads(loads: np.ndarray) -> np.ndarray:
    w = np.asarray(loads, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {w.shape}")
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError("loads must be finite and non-negative")
    return w
