"""The prefix cache's block hashes, shared by both sides: a gateway hashes a request's prompt
exactly as a worker does, to route it to the worker holding its prefix.

A full block's hash is chained: hash(parent hash, its token ids), and the chain's root is
hash(model id, cache salt). Two requests share a block only if they share the model, the salt
and every token up to the end of that block, so tenants with different salts never share
(and cannot time each other's prompts).
"""
from __future__ import annotations

import hashlib
import struct


def root_hash(model_id: str, cache_salt: str | None) -> bytes:
    """The chain's root: the model and the namespace (salt) the request belongs to."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model_id.encode())
    h.update(b"\x00salt\x00" + (cache_salt.encode("utf-8", "surrogatepass")
                                if cache_salt is not None else b"\xff"))
    return h.digest()


def chain_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def block_hashes(root: bytes, token_ids: list[int], block_size: int,
                 known: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids`, reusing the `known` leading hashes."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
