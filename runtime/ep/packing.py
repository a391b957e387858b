"""The two greedy steps of expert placement, on one layer's loads (float64 numpy vectors).

- `replicate`: given each logical expert's load and a number of physical slots (at least one
  per expert), the replica count of each expert that minimises the largest load one replica
  carries (each expert's tokens split evenly over its replicas). Giving each extra slot to the
  expert whose replicas are the most loaded now is optimal for that objective (the classic
  greedy for min-max apportionment), and it replicates only hot experts: an expert gets a
  second replica only while its load is at least every unreplicated expert's.
- `pack`: items (experts, groups of experts, replicas) onto packs (workers, nodes) with
  exactly `len(items) / packs` items each, minimising the heaviest pack: longest-processing-
  time first (heaviest item to the lightest pack with room), then pairwise swaps between the
  heaviest pack and another (the swap that lowers their larger total the most), while one
  lowers it. Items sharing a `key` (replicas of
  one expert) avoid sharing a pack when a pack with room allows: a second replica on the same
  worker would split nothing.

Ties break by index, so the same loads give the same placement on every machine.
"""
from __future__ import annotations

import heapq

import numpy as np


def replicate(loads: np.ndarray, slots: int) -> np.ndarray:
    """Replica count per expert (int64, each >= 1, summing to `slots`)."""
    n = loads.shape[0]
    if slots < n:
        raise ValueError(f"{slots} slots cannot hold {n} experts once each")
    counts = np.ones(n, dtype=np.int64)
    # max-heap on the load one replica carries, ties to the lower expert id
    heap = [(-float(w), i) for i, w in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(slots - n):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-float(loads[i]) / counts[i], i))
    return counts


def pack(weights: np.ndarray, packs: int, keys: np.ndarray | None = None,
         swap_rounds: int | None = None) -> np.ndarray:
    """The pack of each item (int64 [items]); every pack gets exactly items/packs of them."""
    n = weights.shape[0]
    if packs <= 0 or n % packs:
        raise ValueError(f"{n} items do not split evenly over {packs} packs")
    per_pack = n // packs
    keys = np.arange(n) if keys is None else keys
    where = np.full(n, -1, dtype=np.int64)
    totals = np.zeros(packs)
    fill = np.zeros(packs, dtype=np.int64)
    held: list[set[int]] = [set() for _ in range(packs)]
    # heaviest first; a stable sort keeps equal weights in index order
    for i in np.argsort(-weights, kind="stable"):
        room = fill < per_pack
        clash = np.array([int(keys[i]) in h for h in held])
        free = room & ~clash
        choice = free if free.any() else room
        candidates = np.flatnonzero(choice)
        p = int(candidates[np.argmin(totals[candidates])])
        where[i], totals[p], fill[p] = p, totals[p] + weights[i], fill[p] + 1
        held[p].add(int(keys[i]))
    members = np.argsort(where, kind="stable").reshape(packs, per_pack)  # items of each pack
    rounds = 4 * n if swap_rounds is None else swap_rounds
    for _ in range(rounds):
        if not _swap_once(weights, keys, members, totals):
            break
    where[members.reshape(-1)] = np.repeat(np.arange(packs), per_pack)
    return where


def _swap_once(weights: np.ndarray, keys: np.ndarray, members: np.ndarray,
               totals: np.ndarray) -> bool:
    """The swap between the heaviest pack and another that lowers their larger total the
    most (allowed by the keys); False when none does. members: [packs, per pack] item ids."""
    top = int(np.argmax(totals))
    mine = weights[members[top]]  # [per pack]
    diff = mine[None, :, None] - weights[members][:, None, :]  # [packs, mine, theirs]
    gap = (totals[top] - totals)[:, None, None]
    new_max = np.maximum(totals[top] - diff, totals[:, None, None] + diff)
    new_max[(diff <= 0) | (diff >= gap)] = np.inf  # includes the top pack itself (gap 0)
    for flat in np.argsort(new_max, axis=None, kind="stable"):
        other, a, b = np.unravel_index(int(flat), new_max.shape)
        if not np.isfinite(new_max[other, a, b]):
            return False
        i, j = int(members[top, a]), int(members[other, b])
        if _keys_allow(keys, members[top], members[other], i, j):
            members[top, a], members[other, b] = j, i
            d = weights[i] - weights[j]
            totals[top] -= d
            totals[other] += d
            return True
    return False


def _keys_allow(keys: np.ndarray, pack_i: np.ndarray, pack_j: np.ndarray, i: int, j: int
                ) -> bool:
    """Whether swapping item i (in pack_i) with item j (in pack_j) puts no second item of a
    key in either pack."""
    if keys[i] == keys[j]:
        return True
    return keys[i] not in keys[pack_j[pack_j != j]] and keys[j] not in keys[pack_i[pack_i != i]]
