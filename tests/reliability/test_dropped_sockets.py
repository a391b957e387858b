"""Every way a WebSocket connection drops cancels its requests at once; each case failed before.

The peers here are raw sockets driven frame by frame (`RawWebSocket`), so a test decides
exactly what the gateway sees: pings never answered, a close handshake left half done, a
request and its cancel in one TCP write. The gateway runs the fake engine under uvloop, whose
transports raise `ValueError` (not `OSError`) for a socket already closed: the hard close after
a ping timeout used to raise it and skip the cancel, so the requests ran on to their end.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
import time

import pytest

from gateway.http.hard_close import hard_close
from tests.reliability.conftest import Gateway

MAX_TOKENS = 600  # 12 s at 20 ms a step: far past every deadline below
SLACK = 1.5  # seconds from a drop to the requests' settled ledger rows
OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 1, 2, 8, 9, 10


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """Named like conftest's so its after-every-case check runs here: pings every 2 s after
    the peer's last frame, a peer dropped 1 s after an unanswered one."""
    server = Gateway(tmp_path_factory.mktemp("drops"), "--fake-step-ms", "20",
                     "--max-num-seqs", "64", "--send-timeout-seconds", "2")
    yield server
    server.stop()


def client_frame(opcode: int, payload: bytes) -> bytes:
    """One masked client frame (RFC 6455)."""
    mask, n = os.urandom(4), len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def request(rid: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"type": "request", "id": rid, "endpoint": "completions",
            "body": {"prompt": "drop me", "max_tokens": max_tokens}}


class RawWebSocket:
    """A WebSocket peer on a plain socket: a thread reads and parses all the server sends,
    answers pings only when `pong` is set, and notes (wall clock) when the server hung up."""

    def __init__(self, port: int, key: str, pong: bool = False):
        self.pong = pong
        self.messages: list[dict] = []
        self.ended_at: float | None = None
        self._send_lock = threading.Lock()
        self.sock = socket.create_connection(("127.0.0.1", port))
        nonce = base64.b64encode(os.urandom(16))
        self.sock.sendall(b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                          b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                          b"Sec-WebSocket-Key: " + nonce + b"\r\nAuthorization: Bearer " +
                          key.encode() + b"\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(4096)
        head, self._buf = head.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def send(self, *messages: dict) -> None:
        """All the messages in one TCP write: the gateway reads them as one batch."""
        self._write(b"".join(client_frame(OP_TEXT, json.dumps(m).encode()) for m in messages))

    def send_close(self) -> None:
        self._write(client_frame(OP_CLOSE, struct.pack("!H", 1000)))

    def _write(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def _read_loop(self) -> None:
        try:
            while chunk := self.sock.recv(1 << 16):
                self._buf += chunk
                self._parse()
        except OSError:
            pass  # reset by the gateway, or closed by the test
        self.ended_at = time.time()

    def _parse(self) -> None:
        while len(self._buf) >= 2:
            opcode, n, start = self._buf[0] & 0x0F, self._buf[1] & 0x7F, 2
            if n >= 126:
                size = 2 if n == 126 else 8
                if len(self._buf) < 2 + size:
                    return
                n, start = int.from_bytes(self._buf[2:2 + size], "big"), 2 + size
            if len(self._buf) < start + n:
                return
            payload, self._buf = self._buf[start:start + n], self._buf[start + n:]
            if opcode in (OP_TEXT, OP_BINARY):
                self.messages.append(json.loads(payload))
            elif opcode == OP_PING and self.pong:
                self._write(client_frame(OP_PONG, payload))

    def completion_ids(self) -> dict[str, str]:
        """Request id -> the completion id its chunks carry (the ledger row's id)."""
        return {m["id"]: m["data"]["id"] for m in list(self.messages) if m["type"] == "chunk"}

    def final(self, rid: str, after: int = 0) -> dict | None:
        """The message that ended `rid`, looking from message number `after`."""
        return next((m for m in self.messages[after:] if m.get("id") == rid
                     and m["type"] in ("done", "error")), None)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(5)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def streaming_peers(gw: Gateway, key: str, sockets: int, per_socket: int) -> list[RawWebSocket]:
    """Peers whose requests have all streamed their first chunk (so each is in a worker)."""
    peers = [RawWebSocket(gw.port, key) for _ in range(sockets)]
    for peer in peers:
        peer.send(*(request(f"r{i}") for i in range(per_socket)))
    for peer in peers:
        wait_until(lambda p=peer: len(p.completion_ids()) == per_socket, 10, "first chunks")
    return peers


def assert_cancelled_by(gw: Gateway, peers: list[RawWebSocket], deadlines: list[float],
                        tenant: str, since: float) -> None:
    """Each peer's requests settled as cancelled, part-way, by its deadline (unix time):
    aborted when the socket went, not run on to their end and billed in full."""
    ids = {cid: deadline for peer, deadline in zip(peers, deadlines, strict=True)
           for cid in peer.completion_ids().values()}
    time.sleep(max(0.0, max(deadlines) + SLACK - time.time()))
    running = gw.gauges()["vllm:num_requests_running"]  # the workers' own view, right now

    def rows():
        got = [r for r in gw.ledger_rows("tenant = ? AND created >= ?", (tenant, since - 1))
               if r["id"] in ids]
        return got if len(got) == len(ids) else None
    settled = wait_until(rows, 20, "every request's ledger row")
    late = [(r["id"], r["status"], r["output_tokens"], round(r["finished"] - ids[r["id"]], 2))
            for r in settled if r["status"] != "cancelled" or r["output_tokens"] >= MAX_TOKENS
            or r["finished"] > ids[r["id"]] + SLACK]
    assert not late, f"{len(late)} of {len(settled)} ran on past the drop: {late[:4]}"
    assert running == 0, f"{running:g} requests still running {SLACK} s after the last drop"


def test_peers_that_answer_no_ping_have_every_request_cancelled(gw):
    """4 sockets x 8 streams that read everything but never pong: each socket is dropped 3 s
    after its last frame and its requests end with it. Before: uvloop's ValueError from the
    hard close skipped the cancel and the requests ran on for ~12 s, billed in full."""
    since = time.time()
    peers = streaming_peers(gw, "sk-beta", 4, 8)
    for peer in peers:
        wait_until(lambda p=peer: p.ended_at, 10, "the gateway to drop a silent peer")
    assert_cancelled_by(gw, peers, [p.ended_at for p in peers], "beta", since)
    for peer in peers:
        peer.close()


def test_sockets_closed_one_by_one_with_a_slow_handshake(gw):
    """4 sockets x 6 streams closed in turn: each sends its close frame and holds the
    handshake half done for 1.2 s while the next waits (no pongs meanwhile). Each socket's
    requests end when its close frame arrives or the gateway drops it, whichever is first."""
    since = time.time()
    peers = streaming_peers(gw, "sk-storm", 4, 6)
    deadlines = []
    for peer in peers:
        peer.send_close()
        closing = time.time()
        time.sleep(1.2)
        deadlines.append(min(closing, peer.ended_at or closing))
        peer.close()
    assert_cancelled_by(gw, peers, deadlines, "storm", since)


def test_a_cancel_sent_with_its_request_ends_it_and_frees_the_id(gw):
    """Request and cancel in one TCP write, for 10 ids: each gets its final message, and each
    id can be used again at once. Before: the task was cancelled before it first ran, so no
    message came and the id stayed 'already in flight' for the socket's life."""
    peer = RawWebSocket(gw.port, "sk-alpha", pong=True)
    rids = [f"c{i}" for i in range(10)]
    peer.send(*(m for rid in rids for m in (request(rid), {"type": "cancel", "id": rid})))
    for rid in rids:
        final = wait_until(lambda r=rid: peer.final(r), 5, f"the final message of {rid}")
        assert final["type"] == "done" or final["error"]["type"] == "cancelled", final
    seen = len(peer.messages)
    peer.send(*(request(rid, max_tokens=3) for rid in rids))
    for rid in rids:
        final = wait_until(lambda r=rid: peer.final(r, seen), 10, f"{rid} served again")
        assert final["type"] == "done", final
    peer.close()


class _Sock:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def setsockopt(self, *args):
        raise self.exc


class _Transport:
    def __init__(self, sock_exc: BaseException | None, abort_exc: BaseException | None = None):
        self.sock = _Sock(sock_exc) if sock_exc else None
        self.abort_exc = abort_exc
        self.aborted = False

    def get_extra_info(self, name):
        return self.sock

    def abort(self):
        self.aborted = True
        if self.abort_exc is not None:
            raise self.abort_exc


@pytest.mark.parametrize("sock_exc", [ValueError("negative file descriptor"),
                                      OSError(9, "bad fd"), RuntimeError("closed")])
def test_hard_close_aborts_whatever_the_socket_raises(sock_exc):
    """The transport is aborted even when the socket option fails, and nothing escapes."""
    transport = _Transport(sock_exc)
    hard_close(transport)
    assert transport.aborted


def test_hard_close_swallows_a_failing_abort():
    hard_close(_Transport(ValueError("negative file descriptor"), RuntimeError("gone")))
