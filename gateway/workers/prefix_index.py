"""Which worker holds which cached prefix: the gateway's index of the workers' KV events.

Each worker reports the chained block hashes (hex) its prefix cache stores and evicts
(`KvEvents` frames, runtime/kv/events.py); the index keeps, per worker, the set it holds now.
A request's prompt is hashed exactly as a worker hashes it (runtime/kv/prefix_cache.py: rooted in
the worker's model id and the request's cache salt, one hash per full block, the last prompt
token never served from the cache), and its cached prefix on a worker is the run of leading
hashes that worker holds: a chain is useless past its first miss.

A worker is known by its handle's index and its incarnation (its process id): a restarted
worker starts empty, so the first frame of a new incarnation, like any frame with `cleared`,
replaces the view; `retain` drops workers that died or left the fleet.
"""
from __future__ import annotations

from collections.abc import Mapping

from contract.block_hashing import chain_hash, root_hash
from contract.frames import KvEvents


def cache_model_id(info) -> str:
    """The model id a worker roots its hashes in, from its Ready frame: `model_id` where the
    frame carries it; otherwise `model`, which is the fake engine's model id (a model engine's
    id also names the weights file and dtype, so without the field its prefixes never match
    and dispatch falls back to hashing)."""
    return getattr(info, "model_id", None) or info.model


class BlockChain:
    """One prompt's chained block hashes (hex) under one root and block size, computed only
    as far as a lookup walks."""

    def __init__(self, root: bytes, tokens: list[int], block_size: int):
        self._tokens, self._block_size = tokens, block_size
        self._parent = root
        self._hashes: list[str] = []
        self.num_blocks = (len(tokens) - 1) // block_size if tokens else 0

    def __getitem__(self, i: int) -> str:
        bs = self._block_size
        while len(self._hashes) <= i:
            n = len(self._hashes)
            self._parent = chain_hash(self._parent, self._tokens[n * bs:(n + 1) * bs])
            self._hashes.append(self._parent.hex())
        return self._hashes[i]


class PrefixHashes:
    """A request's prompt and salt, with one lazily computed chain per (model id, block size):
    workers of one fleet usually share both, so the prompt is hashed once per dispatch."""

    def __init__(self, prompt: list[int], salt: str | None):
        self.prompt, self.salt = prompt, salt
        self._chains: dict[tuple[str, int], BlockChain] = {}

    def chain(self, model_id: str, block_size: int) -> BlockChain:
        key = (model_id, block_size)
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = BlockChain(root_hash(model_id, self.salt), self.prompt,
                                                   block_size)
        return chain


class PrefixIndex:
    """Per worker, the block hashes its prefix cache holds."""

    def __init__(self) -> None:
        self._held: dict[int, set[str]] = {}
        self._incarnation: dict[int, object] = {}

    def apply(self, worker: int, frame: KvEvents, incarnation: object = None) -> None:
        """Fold one KV events frame of `worker` (removed, then stored: a batch names each hash
        once, so the order only matters for a sender that repeats one)."""
        held = self._held.get(worker)
        if held is None or frame.cleared or self._incarnation.get(worker) != incarnation:
            held = self._held[worker] = set()
            self._incarnation[worker] = incarnation
        held.difference_update(frame.removed)
        held.update(frame.stored)

    def forget(self, worker: int) -> None:
        self._held.pop(worker, None)
        self._incarnation.pop(worker, None)

    def retain(self, live: Mapping[int, object]) -> None:
        """Keep only the workers in `live` (index -> incarnation), at that incarnation."""
        for worker in [w for w, inc in self._incarnation.items()
                       if w not in live or live[w] != inc]:
            self.forget(worker)

    def workers(self) -> list[int]:
        return list(self._held)

    def num_held(self, worker: int) -> int:
        return len(self._held.get(worker, ()))

    def cached_blocks(self, worker: int, incarnation: object, chain: BlockChain) -> int:
        """How many leading blocks of `chain` the worker holds (0 for another incarnation)."""
        held = self._held.get(worker)
        if not held or self._incarnation.get(worker) != incarnation:
            return 0
        n = 0
        while n < chain.num_blocks and chain[n] in held:
            n += 1
        return n
