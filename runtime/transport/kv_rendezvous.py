"""The KV-transfer rendezvous, kept to this node's own address and to holders of the secret.

The gateway serves one TCPStore on one address (loopback for pipe workers, the node's IP in
Ray mode), never every interface: a torch TCPStore master listens on all of them whatever
host it is given, so `serve_store` binds the socket itself and hands it over by descriptor.

A worker pair's two-rank gloo group meets in that store under a name derived from the
gateway's secret (random per start, given to workers in `INFERSTACK_KV_SECRET`, never on a
command line) and the pair key, so a client without the secret cannot find a group by its
plain name. A store client can still list keys, so every value a group writes is sealed with
a MAC keyed by the secret (a forged or altered rendezvous address is refused), and once the
group is connected both ranks prove they hold the key over its own connection before any KV
moves. Each rank's gloo listener binds the address that routes to the store, not every one.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket

import torch
import torch.distributed as dist

SECRET_ENV = "INFERSTACK_KV_SECRET"
SECRET_FLAG = "--kv-secret"  # Ray actors only: their argv is a Ray call, not a command line
MAC_BYTES = 32


def new_secret() -> str:
    return secrets.token_hex(16)


def secret_from_env() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:  # a worker never falls back to open, unauthenticated groups
        raise RuntimeError(f"{SECRET_ENV} must hold the gateway's KV-transfer secret")
    return secret


def pop_secret_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """`argv` without `--kv-secret S`, and S (None when absent)."""
    if SECRET_FLAG not in argv:
        return list(argv), None
    i = argv.index(SECRET_FLAG)
    return argv[:i] + argv[i + 2:], argv[i + 1]


# ---- the store --------------------------------------------------------------------------
def serve_store(host: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore master that listens on `host` (an IP literal, not a wildcard) alone."""
    ip = ipaddress.ip_address(host)  # a name could resolve to anything: refuse it
    if ip.is_unspecified:
        raise ValueError(f"the KV store must bind one address, not {host}")
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it itself
    return store


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (loopback for loopback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: nothing is sent; the kernel picks the source address
        return s.getsockname()[0]


# ---- a pair's group ---------------------------------------------------------------------
def _derive(secret: str, purpose: bytes, pair: str) -> bytes:
    return hmac.new(secret.encode(), purpose + b"\0" + pair.encode(), hashlib.sha256).digest()


def group_name(secret: str, pair: str) -> str:
    """The store prefix of a pair's group: unguessable without the secret."""
    return "kv/" + _derive(secret, b"name", pair).hex()[:32]


def group_key(secret: str, pair: str) -> bytes:
    """The MAC key of a pair's group, distinct from its name."""
    return _derive(secret, b"mac", pair)


class SealedStore(dist.Store):
    """A store whose values carry a MAC over their key and bytes; a bad one is refused.
    Gloo's rendezvous uses only set, get, wait and check."""

    def __init__(self, inner: dist.Store, mac_key: bytes):
        super().__init__()
        self.inner, self.mac_key = inner, mac_key

    def _mac(self, key: str, value: bytes) -> bytes:
        name = key.encode()
        return hmac.new(self.mac_key, len(name).to_bytes(4, "big") + name + value,
                        hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        sealed = self.inner.get(key)
        mac, value = sealed[:MAC_BYTES], sealed[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise PermissionError(f"KV rendezvous value {key!r} failed authentication")
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)


def open_group(store: dist.Store, secret: str, pair: str, rank: int, store_host: str,
               timeout: datetime.timedelta):
    """The authenticated two-rank gloo group of a worker pair; blocks until the peer joins.
    Returns (group, sealed store): gloo holds the Python store only by a C++ pointer."""
    key = group_key(secret, pair)
    sealed = SealedStore(dist.PrefixStore(group_name(secret, pair), store), key)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, no stub
    options._devices = [dist.ProcessGroupGloo.create_device(
        hostname=local_address(store_host))]
    options._timeout = timeout
    pg = dist.ProcessGroupGloo(sealed, rank, 2, options)
    prove(pg, key, rank, timeout)
    return pg, sealed


def prove(pg, key: bytes, rank: int, timeout: datetime.timedelta) -> None:
    """Both ranks show they hold `key` over the group's own connection: fresh nonces from
    each side, then a MAC over both nonces and the rank, checked by the other side. A peer
    that slipped into the connection without the key fails here, before any KV is sent."""
    nonces = _exchange(pg, secrets.token_bytes(16), timeout)
    transcript = nonces[0] + nonces[1]
    proofs = _exchange(pg, _proof(key, rank, transcript), timeout)
    if not hmac.compare_digest(proofs[1 - rank], _proof(key, 1 - rank, transcript)):
        raise PermissionError("the KV peer failed authentication")


def _proof(key: bytes, rank: int, transcript: bytes) -> bytes:
    return hmac.new(key, b"rank%d" % rank + transcript, hashlib.sha256).digest()


def _exchange(pg, data: bytes, timeout: datetime.timedelta) -> list[bytes]:
    """Each rank's `data` (same length on both), in rank order."""
    mine = torch.tensor(list(data), dtype=torch.uint8)
    both = [torch.empty_like(mine) for _ in range(2)]
    pg.allgather([both], [mine]).wait(timeout)
    return [t.numpy().tobytes() for t in both]
