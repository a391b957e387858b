"""A worker many gateways share: `python -m runtime serve --port P [--host 127.0.0.1] ...`.

One engine and one scheduler (the flags of runtime.transport.worker) serve every gateway that
connects over TCP, with the pipe worker's frames and frame loop (runtime/transport/worker.py). Each
connection gets its own Ready frame and a snapshot of the prefix cache; its request ids are prefixed
inside the engine (two gateways may use the same id) and its outputs go back to it alone;
prefix-cache events and stats go to all. When a connection ends (closed, dropped, a frame the
worker cannot read, a `Shutdown` frame: that gateway leaves), its requests are aborted and
their blocks freed; the others go on. SIGTERM or SIGINT stops the worker.

Security: it listens on loopback unless told otherwise, and beyond loopback only with a shared
secret (INFERSTACK_WORKER_TOKEN, at least 16 characters) that every connection must prove with
the HMAC handshake of contract/frames.py before one of its frames is read. With the secret
set it is asked on loopback too.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from contract.frames import (
    MAC_BYTES,
    NONCE_BYTES,
    TOKEN_ENV,
    AbortRequest,
    AddRequest,
    Frame,
    IdleStats,
    Output,
    Rejected,
    Shutdown,
    Step,
    check_proof,
    encode_frame,
    hello,
    is_loopback,
    proof,
    read_frame_blocking,
)
from contract.gc_tuning import tune_gc_for_serving
from runtime.transport.worker import StreamLink, Worker, build_parser, start_engine

log = logging.getLogger("runtime.transport.serve")
HANDSHAKE_SECONDS = 10.0  # a peer that has not proved the secret by then is dropped
MAX_CONNECTIONS = 256  # connections at once, handshakes included
MAX_UNSENT_BYTES = 256 << 20  # a gateway this far behind in reading is cut off
MIN_TOKEN_CHARS = 16


class SocketLink(StreamLink):
    """One gateway's connection. Frames are queued for a writer thread, so a gateway that
    reads slowly never stalls the engine for the others; past MAX_UNSENT_BYTES it is cut off.
    Closing shuts the socket down, which ends its reader, which reports the departure."""

    def __init__(self, sock: socket.socket, number: int, peer: str):
        super().__init__(None)
        self.sock, self.number, self.peer = sock, number, peer
        self.prefix = f"{number}#"  # digits then '#': no prefix starts another
        self.requests: set[str] = set()  # engine ids of its requests in the engine
        self.closed = False
        self._unsent: queue.SimpleQueue = queue.SimpleQueue()
        self._unsent_bytes = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._write_loop, daemon=True,
                         name=f"gateway-{number}-writer").start()

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        with self._lock:
            self._unsent_bytes += len(data)
            behind = self._unsent_bytes > MAX_UNSENT_BYTES
        if behind:
            log.warning("gateway %s reads too slowly (%d bytes unsent); closing it",
                        self.peer, self._unsent_bytes)
            self.close()
            return
        self._unsent.put(data)

    def _write_loop(self) -> None:
        while (data := self._unsent.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                return
            with self._lock:
                self._unsent_bytes -= len(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._unsent.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass(frozen=True)
class _Joined:
    link: SocketLink


@dataclass(frozen=True)
class _Received:
    link: SocketLink
    frame: Frame


@dataclass(frozen=True)
class _Departed:
    link: SocketLink
    reason: str


class SharedWorker(Worker):
    """The worker's frame loop for many gateways: ids namespaced per connection, outputs
    routed to their owner, KV events and stats to every connection."""

    def __init__(self, engine, sampling_defaults: dict | None = None):
        super().__init__(engine)
        self.sampling_defaults = sampling_defaults or {}
        self.links: list[SocketLink] = []
        self.owners: dict[str, SocketLink] = {}  # engine request id -> its gateway

    def apply(self, command) -> None:
        match command:
            case _Joined(link=link):
                self.publish_kv_events()  # to the others: the newcomer's snapshot holds them
                self.greet(link, self.sampling_defaults)
                self.links.append(link)
                log.info("gateway %s joined (%d connected)", link.peer, len(self.links))
            case _Received(link=link, frame=frame) if not link.closed:
                self.receive(link, frame)
            case _Departed(link=link, reason=reason):
                self.depart(link, reason)
            case Shutdown():  # from the signal handler: the worker stops
                self.running = False

    def receive(self, link: SocketLink, frame: Frame) -> None:
        match frame:
            case AddRequest():
                engine_id = link.prefix + frame.id
                error = self.admit(dataclasses.replace(frame, id=engine_id))
                if error is not None:
                    link.send(Rejected(frame.id, error))
                else:
                    self.owners[engine_id] = link
                    link.requests.add(engine_id)
            case AbortRequest(id=request_id) if link.prefix + request_id in link.requests:
                self.abort(link.prefix + request_id)
            case AbortRequest():
                pass  # finished meanwhile: its final output is on its way
            case Shutdown():  # this gateway leaves; the others stay
                link.close()
            case _:  # KV moves need a gateway's own pair of workers, not a shared one
                log.warning("gateway %s sent a %s frame; closing it", link.peer,
                            type(frame).__name__)
                link.close()

    def depart(self, link: SocketLink, reason: str) -> None:
        link.close()
        for engine_id in link.requests:
            self.owners.pop(engine_id, None)
            self.engine.abort_request(engine_id)  # frees its blocks; nobody to tell
        log.info("gateway %s left (%s): %d requests aborted", link.peer, reason,
                 len(link.requests))
        link.requests.clear()
        if link in self.links:
            self.links.remove(link)

    # ---- routing ------------------------------------------------------------------------
    def _owner(self, engine_id: str, finished: bool) -> SocketLink | None:
        link = self.owners.get(engine_id)
        if link is not None and finished:
            del self.owners[engine_id]
            link.requests.discard(engine_id)
        return link

    def _own_stats(self, stats: dict, link: SocketLink) -> dict:
        # what the gateway needs to tell its own load on this worker from the others'
        return {**stats, "connection_requests": len(link.requests)}

    def send_step(self, messages: list[Output], stats: dict | None) -> None:
        by_link: dict[SocketLink, list[Output]] = {link: [] for link in self.links}
        for m in messages:
            link = self._owner(m["id"], m["finished"])
            if link is None or link not in by_link:
                continue  # its gateway left; the request was aborted then
            m["id"] = m["id"][len(link.prefix):]
            by_link[link].append(m)
        for link, outputs in by_link.items():
            if outputs or stats is not None:
                link.send(Step(outputs, None if stats is None else self._own_stats(stats, link)))

    def send_rejected(self, request_id: str, error: dict) -> None:
        link = self._owner(request_id, finished=True)
        if link is not None:
            link.send(Rejected(request_id[len(link.prefix):], error))

    def send_idle_stats(self, stats: dict) -> None:
        for link in self.links:
            link.send(IdleStats(self._own_stats(stats, link)))

    def broadcast(self, frame: Frame) -> None:
        data = encode_frame(frame)  # once for all
        for link in self.links:
            link.write(data)

    def stats(self, step) -> dict:
        return {**super().stats(step), "connections": len(self.links)}


# ---- connections ----------------------------------------------------------------------
class Listener:
    """Accepts gateways: one thread per connection runs the handshake, then reads its frames
    into the worker's command queue until the connection ends."""

    def __init__(self, server: socket.socket, worker: SharedWorker, token: str | None):
        self.server, self.worker, self.token = server, worker, token
        self.count = 0
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def accept_loop(self) -> None:
        while True:
            try:
                sock, address = self.server.accept()
            except OSError:
                return  # the server socket closed: the worker is stopping
            if not self.slots.acquire(blocking=False):
                log.warning("refusing %s: %d connections already", address, MAX_CONNECTIONS)
                sock.close()
                continue
            self.count += 1
            peer = f"{address[0]}:{address[1]}"
            threading.Thread(target=self.serve, args=(sock, self.count, peer),
                             daemon=True, name=f"gateway-{self.count}-reader").start()

    def serve(self, sock: socket.socket, number: int, peer: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames, now
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # notice dead peers
            if not self.handshake(sock, peer):
                return
            link = SocketLink(sock, number, peer)
            self.worker.commands.put(_Joined(link))
            self.worker.commands.put(_Departed(link, self.read(link)))
        finally:
            sock.close()
            self.slots.release()

    def handshake(self, sock: socket.socket, peer: str) -> bool:
        """The hello, and with a secret the proofs both ways; False drops the peer before
        anything it sent is read as a frame."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            sock.sendall(hello(self.token is not None, nonce))
            if self.token is not None:
                answer = _recv_exactly(sock, NONCE_BYTES + MAC_BYTES)  # short at EOF
                theirs, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
                if not check_proof(self.token, b"gateway", nonce, theirs, mac):
                    log.warning("refusing %s: it did not prove the secret", peer)
                    return False
                sock.sendall(proof(self.token, b"worker", theirs, nonce))
            sock.settimeout(None)
            return True
        except OSError as exc:
            log.warning("refusing %s: handshake failed (%s)", peer, exc)
            return False

    def read(self, link: SocketLink) -> str:
        """Queue the connection's frames until it ends; why it ended."""
        stream = link.sock.makefile("rb")
        try:
            while (frame := read_frame_blocking(stream)) is not None:
                self.worker.commands.put(_Received(link, frame))
            return "closed"
        except Exception as exc:  # noqa: BLE001 - a bad frame ends this connection only
            return f"{type(exc).__name__}: {exc}"[:200]
        finally:
            stream.close()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := sock.recv(size - len(data))):
        data += chunk
    return data


def check_exposure(host: str, token: str | None) -> None:
    """Beyond loopback only with a secret: anyone who reaches an open worker can run
    requests on it, read what it generates for others and stall it."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} characters")
    if token is None and not is_loopback(host):
        raise SystemExit(f"refusing to listen on {host!r} without a shared secret: set "
                         f"{TOKEN_ENV} here and on every gateway, or listen on 127.0.0.1")


def parse_args(argv=None):
    p = build_parser("python -m runtime serve")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help=f"address to listen on (loopback by default; beyond it {TOKEN_ENV} "
                        f"is required)")
    args = p.parse_args(argv)
    if args.kv_store:
        p.error("--kv-store: a shared worker does not move KV between workers")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    token = os.environ.get(TOKEN_ENV) or None
    check_exposure(args.host, token)
    worker = SharedWorker(*start_engine(args))  # a start error: one line, exit 3
    worker.drain_kv_events()  # a fresh engine's: each greeting's snapshot holds them
    server = socket.create_server((args.host, args.port), backlog=64)  # SO_REUSEADDR: restarts
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.commands.put(Shutdown()))
    tune_gc_for_serving()
    threading.Thread(target=Listener(server, worker, token).accept_loop, daemon=True,
                     name="accept").start()
    host, port = server.getsockname()[:2]
    log.info("serving %s on tcp://%s:%d%s", worker.engine.info()["model"], host, port,
             " (secret required)" if token else "")
    worker.loop()
    server.close()
    for link in list(worker.links):
        link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
