"""A worker several gateways share, reached over TCP at tcp://HOST:PORT
(runtime/transport/serve.py).

The same frames, placements, load and events as a worker process (gateway/workers/handle.py):
only how it starts, how frames travel and how it comes back differ. A connection begins with
the handshake of contract/frames.py: the secret (INFERSTACK_WORKER_TOKEN) is proved, never
sent, when the worker asks for it, and a gateway that has one refuses a worker that does not
ask (it could be anyone's). When the connection drops, the requests in flight on it fail as
a dead process's do (the worker has aborted them on its side) and the handle reconnects with
backoff instead of starting a process. Its load counts the other gateways' requests too.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from urllib.parse import urlsplit

from contract.frames import (
    HELLO_BYTES,
    MAC_BYTES,
    NONCE_BYTES,
    TOKEN_ENV,
    ProtocolError,
    Ready,
    Shutdown,
    check_proof,
    encode_frame,
    parse_hello,
    proof,
    read_frame,
)
from gateway.workers.backoff import Backoff
from gateway.workers.events import WorkerEvents
from gateway.workers.handle import WorkerHandle

log = logging.getLogger(__name__)


def parse_worker_url(url: str) -> tuple[str, int]:
    """(host, port) of tcp://HOST:PORT; ValueError for anything else."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"a worker URL is tcp://HOST:PORT, not {url!r}")
    return parts.hostname, port


def remote_worker_handles(urls, events: WorkerEvents | None, first_index: int = 0,
                          ready_timeout: float = 300.0,
                          token: str | None = None) -> list[RemoteWorkerHandle]:
    """One handle per URL, numbered after the gateway's own workers; the app starts and
    closes them as it does its own. The secret is INFERSTACK_WORKER_TOKEN's unless given."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    return [RemoteWorkerHandle(first_index + i, url, token, ready_timeout, events)
            for i, url in enumerate(urls)]


class RemoteWorkerHandle(WorkerHandle):
    supervised = False  # it reconnects by itself; there is no process to restart

    def __init__(self, index: int, url: str, token: str | None = None,
                 ready_timeout: float = 300.0, events: WorkerEvents | None = None,
                 connect_timeout: float = 10.0, max_backoff: float = 10.0):
        super().__init__(index, [], ready_timeout=ready_timeout, events=events)
        self.url = url
        self.host, self.port = parse_worker_url(url)
        self.token = token
        self.connect_timeout = connect_timeout
        self.backoff = Backoff(most=max_backoff)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._connection: asyncio.Task | None = None  # connects, waits out a loss, reconnects
        self._attempt: asyncio.Future | None = None  # the latest attempt's outcome
        self._was_ready = False

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Connect and stay connected (the first call starts that). Returns when connected;
        raises the latest attempt's error while the handle goes on trying with backoff."""
        if self._connection is None:
            self._attempt = self._new_attempt()
            self._connection = asyncio.create_task(self._stay_connected(),
                                                   name=f"worker-{self.index}-connection")
        if not self.alive:
            await asyncio.shield(self._attempt)

    @staticmethod
    def _new_attempt() -> asyncio.Future:
        attempt = asyncio.get_running_loop().create_future()
        # its error is logged when it happens; nobody need be waiting for it
        attempt.add_done_callback(lambda f: f.cancelled() or f.exception())
        return attempt

    async def _stay_connected(self) -> None:
        while not self._closing:
            if self._attempt.done():
                self._attempt = self._new_attempt()
            try:
                await self._connect()
            except Exception as exc:  # noqa: BLE001 - unreachable for now: try again later
                why = str(exc) or type(exc).__name__  # a timeout says nothing itself
                self._attempt.set_exception(ConnectionError(f"worker {self.index} at "
                                                            f"{self.url}: {why}"))
                delay = self.backoff.next()
                log.warning("worker %d at %s: %s; retrying in %.1fs", self.index, self.url,
                            why, delay)
                await asyncio.sleep(delay)
                continue
            self._attempt.set_result(None)
            connected = time.monotonic()
            await asyncio.wait([self._reader])  # wait() leaves the reader alone if cancelled
            if time.monotonic() - connected > self.backoff.most:
                self.backoff.reset()  # a connection that lasted: the next one may come fast
            if not self._closing:
                self._attempt = self._new_attempt()  # start() meanwhile: not connected
                self._attempt.set_exception(ConnectionError(
                    f"worker {self.index} at {self.url}: lost; reconnecting"))
                await asyncio.sleep(self.backoff.next())

    async def _connect(self) -> None:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=64 << 20), self.connect_timeout)
        try:
            await asyncio.wait_for(self._handshake(reader, writer), self.connect_timeout)
            message = await asyncio.wait_for(read_frame(reader), self.ready_timeout)
            if not isinstance(message, Ready):
                raise ProtocolError(f"the worker's first frame is {type(message).__name__}, "
                                    f"not Ready")
        except BaseException:
            writer.transport.abort()
            raise
        self.reader, self.writer = reader, writer
        if self._was_ready:
            self.restarts += 1
        self._was_ready = True
        self._mark_ready(message, self._read_loop())

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        wants_token, nonce = parse_hello(await reader.readexactly(HELLO_BYTES))
        if wants_token and self.token is None:
            raise PermissionError(f"the worker asks for the secret: set {TOKEN_ENV}")
        if not wants_token and self.token is not None:
            raise PermissionError("the worker asks for no secret though this gateway has "
                                  "one: refusing to send it requests")
        if wants_token:
            mine = secrets.token_bytes(NONCE_BYTES)
            writer.write(mine + proof(self.token, b"gateway", nonce, mine))
            try:
                mac = await reader.readexactly(MAC_BYTES)
            except asyncio.IncompleteReadError:
                raise PermissionError("the worker refused this gateway's secret") from None
            if not check_proof(self.token, b"worker", mine, nonce, mac):
                raise PermissionError("the worker did not prove the secret")

    async def close(self, timeout: float = 10.0) -> None:
        """Leave the worker (it aborts whatever of ours it still runs); it serves others on."""
        self._closing = True
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode_frame(Shutdown()))
            self.writer.close()
        if self._reader is not None and not self._reader.done():
            _, pending = await asyncio.wait([self._reader], timeout=timeout)
            for task in pending:
                task.cancel()
        if self._connection is not None:
            self._connection.cancel()
            await asyncio.gather(self._connection, return_exceptions=True)

    def kill(self) -> None:
        """Drop the connection at once, with no reconnection."""
        self._closing = True
        if self.writer is not None:
            self.writer.transport.abort()

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.writer is not None and not self.writer.is_closing()

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info is not None else None  # on the worker's machine

    @property
    def needs_restart(self) -> bool:
        return False

    # ---- load: the other gateways' requests take slots too -----------------------------
    @property
    def others_requests(self) -> int:
        """Requests of other gateways in the worker's engine, as of its last stats (which
        count this connection's requests at the same moment)."""
        s = self.stats
        return max(0, s.get("running", 0) + s.get("waiting", 0) - s.get("connection_requests", 0))

    @property
    def free_slots(self) -> int:
        return self.max_num_seqs - len(self.inflight) - self.others_requests

    @property
    def load(self) -> float:
        return (len(self.inflight) + self.others_requests) / max(1, self.max_num_seqs)

    # ---- frames -------------------------------------------------------------------------
    def _write(self, payload) -> None:
        if self.writer is None or self.writer.is_closing():
            raise ConnectionError(f"worker {self.index} at {self.url} is not connected")
        self.writer.write(payload)

    async def _read_loop(self) -> None:
        why = "the worker closed the connection"
        try:
            while (frame := await read_frame(self.reader)) is not None:
                self._handle(frame)
        except Exception as exc:  # noqa: BLE001 - a broken or garbled connection: a lost worker
            why = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ProtocolError):
                log.exception("worker %d at %s sent a bad frame", self.index, self.url)
        self.writer.transport.abort()
        if not self._closing:
            log.error("worker %d at %s: %s; %d requests failed; reconnecting", self.index,
                      self.url, why, len(self.inflight))
        self._lose(f"worker {self.index} at {self.url} was lost ({why})")
