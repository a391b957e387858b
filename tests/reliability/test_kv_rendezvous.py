"""The KV-transfer rendezvous (issue 15 item 7): the store listens on the one address it is
given, and a store client without the gateway's secret can neither find a worker pair's
group by its plain name nor forge its way into one. Loopback and this machine's own
addresses only; nothing leaves the machine."""
from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import socket
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

from runtime.transport.disagg import KVTransport
from runtime.transport.kv_rendezvous import (
    SECRET_ENV,
    group_name,
    new_secret,
    open_group,
    prove,
    serve_store,
)

SHORT = datetime.timedelta(seconds=3)
PAIR = "4242-4343"  # "<prefill pid>-<decode pid>": guessable, so it must not be the name


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a listening TCP socket on `port` (from /proc/net)."""
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            for line in fh.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(addr)  # each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


def non_loopback_ipv4() -> str:
    """One of this machine's own non-loopback IPv4 addresses, or skip."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # UDP to TEST-NET: nothing is sent
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        candidates += [w.split("/")[0] for line in out.splitlines()
                       for i, w in enumerate(line.split()) if line.split()[i - 1] == "inet"]
    except OSError:
        pass
    for ip in candidates:
        if not ipaddress.ip_address(ip).is_loopback and ip != "0.0.0.0":
            return ip
    pytest.skip("this machine has no non-loopback IPv4 address to probe the store from")


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


# ---- binding ----------------------------------------------------------------------------
def test_store_listens_on_loopback_only():
    store = serve_store("127.0.0.1")
    assert listening_addresses(store.port) == {"127.0.0.1"}
    assert reachable("127.0.0.1", store.port)
    assert not reachable(non_loopback_ipv4(), store.port)


def test_store_on_the_node_ip_is_not_on_loopback():
    ip = non_loopback_ipv4()
    store = serve_store(ip)
    assert listening_addresses(store.port) == {ip}
    assert reachable(ip, store.port) and not reachable("127.0.0.1", store.port)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "localhost"])
def test_store_refuses_wildcards_and_names(host):
    with pytest.raises(ValueError):
        serve_store(host)


def test_ray_store_host_listens_on_the_node_ip(monkeypatch):
    ray = pytest.importorskip("ray")
    from runtime.transport.ray_worker import KVStoreHost
    ip = non_loopback_ipv4()
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ip)
    host = KVStoreHost()
    assert host.get_address() == f"{ip}:{host.store.port}"
    assert listening_addresses(host.store.port) == {ip}


def test_gateway_store_on_loopback_and_secret_only_in_worker_env():
    from aiohttp import web

    from gateway.app import KV_STORE, GatewayWorkerEvents, _create_pd_workers
    from gateway.config import GatewayConfig
    from gateway.serving.inflight import InFlightTable
    from gateway.serving.queue import RequestQueue
    secrets_seen = set()
    for _ in range(2):
        config = GatewayConfig(pd="1:1")
        app = web.Application()
        workers, _ = _create_pd_workers(app, config, RequestQueue(config.max_queue,
                                                                  config.aging_seconds),
                                        InFlightTable(), GatewayWorkerEvents(app))
        assert listening_addresses(app[KV_STORE].port) == {"127.0.0.1"}
        for w in workers:
            secret = w.env[SECRET_ENV]
            assert len(secret) == 32 and all(secret not in arg for arg in w.argv)
            secrets_seen.add(secret)
    assert len(secrets_seen) == 2  # a fresh secret at every start


def test_worker_without_the_secret_refuses_to_start(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SECRET_ENV):
        KVTransport("127.0.0.1:1", lambda message: None)


# ---- namespacing and authentication -----------------------------------------------------
@pytest.fixture
def store():
    return serve_store("127.0.0.1")


def client(store) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=SHORT)


def transports(store, secret):
    """A sending and a receiving transport (two workers), with their posted messages."""
    posted = queue.Queue()
    address = f"127.0.0.1:{store.port}"
    return KVTransport(address, posted.put, secret), KVTransport(address, posted.put, secret), \
        posted


def received(posted, num_blocks: int, timeout: float = 30.0) -> list[torch.Tensor]:
    blocks, deadline = [], time.monotonic() + timeout
    while True:
        m = posted.get(timeout=max(0.01, deadline - time.monotonic()))
        assert m["type"] != "_kv_failed", m
        if m["type"] == "_kv_block":
            blocks.append(m["kv"])
        elif m["type"] == "_kv_done":
            assert m["blocks"] == num_blocks
            return blocks


def test_a_pair_group_is_not_under_its_plain_name(store):
    secret = new_secret()
    sender, receiver, posted = transports(store, secret)
    blocks = [torch.randn(2, 3) for _ in range(3)]
    sender.send("r", PAIR, 1, blocks)
    receiver.recv("r", PAIR, 1, 3, (2, 3), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(blocks, received(posted, 3)))
    keys = client(store).list_keys()
    group_keys = [k for k in keys if k.startswith("kv/")]
    assert group_keys, keys
    assert not any(PAIR in k for k in keys)  # not "kv/4242-4343/...": that is today's name
    assert all(k.startswith(group_name(secret, PAIR) + "/") for k in group_keys)
    assert group_name(new_secret(), PAIR) != group_name(secret, PAIR)


def test_client_without_the_secret_cannot_join_a_waiting_group(store):
    secret = new_secret()
    sender, receiver, posted = transports(store, secret)
    blocks = [torch.randn(4) for _ in range(2)]
    sender.send("r", PAIR, 1, blocks)  # the prefill side waits for its peer
    time.sleep(0.5)
    with pytest.raises(Exception):  # noqa: B017 - gloo's timeout has no exception type of its own
        dist.ProcessGroupGloo(dist.PrefixStore(f"kv/{PAIR}", client(store)), 1, 2, SHORT)
    with pytest.raises(Exception):  # noqa: B017 - a guessed secret: nobody there either
        open_group(client(store), new_secret(), PAIR, 1, "127.0.0.1", SHORT)
    receiver.recv("r", PAIR, 1, 2, (4,), torch.float32)  # the real peer still gets it all
    assert all(torch.equal(a, b) for a, b in zip(blocks, received(posted, 2)))


@pytest.mark.parametrize("forgery", ["unsealed", "replayed from rank 0"])
def test_listed_keys_do_not_let_a_client_forge_a_peer(store, forgery):
    """A client may list the store's keys and so find the group's name; its forged (or
    copied) rendezvous value for the missing peer is refused, so the group never forms."""
    secret, errors = new_secret(), []

    def genuine_prefill_side():
        try:
            open_group(client(store), secret, PAIR, 0, "127.0.0.1", SHORT)
        except Exception as exc:  # noqa: BLE001 - what the test inspects
            errors.append(exc)
    thread = threading.Thread(target=genuine_prefill_side, daemon=True)
    thread.start()
    attacker, deadline = client(store), time.monotonic() + 10
    while not (mine := [k for k in attacker.list_keys() if k.startswith("kv/")]):
        assert time.monotonic() < deadline, "rank 0 never wrote its address"
        time.sleep(0.01)
    prefix, _ = mine[0].rsplit("/", 1)  # "<group name>/<context>/<rank>"
    value = b"forged" if forgery == "unsealed" else attacker.get(mine[0])
    attacker.set(prefix + "/1", value)
    thread.join(20)
    assert errors and "authentication" in str(errors[0])


def test_a_peer_without_the_key_fails_the_handshake(store):
    """Past the rendezvous, each rank proves it holds the group key over the connection."""
    results = {}

    def rank(r: int, key: bytes):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("plain", client(store)), r, 2, SHORT)
        try:
            prove(pg, key, r, SHORT)
            results[r] = "ok"
        except PermissionError:
            results[r] = "refused"
    for keys, expect in (((b"k" * 32, b"k" * 32), "ok"), ((b"k" * 32, b"x" * 32), "refused")):
        for stale in ("plain/0/0", "plain/0/1"):  # the first round's addresses
            store.delete_key(stale)
        threads = [threading.Thread(target=rank, args=(r, keys[r]), daemon=True)
                   for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results == {0: expect, 1: expect}
