"""Prefill/decode disaggregation on a worker: park, export and import requests, and move their
KV blocks over torch.distributed (gloo on CPU; NCCL would take the same calls on CUDA).

A prefill worker runs a request added with "prefill_only" until it samples its first token,
then parks it (blocks kept, out of the batch) and marks that output "prefilled". The gateway
picks a decode worker and sends, at once, "import" to it and "export" to the prefill worker.
The exporter copies the prompt's blocks out and frees the request (its full blocks stay in
its prefix cache); the importer allocates blocks and receives the KV block by block, writes
each with `write_block`, then runs the request from its first token as if it had computed
the prompt itself. An abort on either side frees that side's blocks at once; transfers
already posted run to completion into staging buffers that are then dropped.

Each (prefill process, decode process) pair shares a two-rank gloo group made on first use
through the gateway's TCPStore for the pair key "<prefill pid>-<decode pid>", so a restarted
worker gets fresh groups. The group is namespaced, sealed and checked with the gateway's
secret (`INFERSTACK_KV_SECRET`; runtime/transport/kv_rendezvous.py): no client without it can join.
Sends and receives run on two threads; they follow the gateway's order of transfers, so
they cannot deadlock. Results come back to the worker's main thread as internal messages on
its command queue; only the main thread touches the engine.

Frames (contract/frames.py): gateway -> worker AddRequest(prefill_only=True), ExportKV,
ImportKV; worker -> gateway an output with "prefilled": {"arrival", "scheduled",
"first_token"}, TransferDone, ImportFailed. The transfer threads' results are internal dicts
("_kv_sent", "_kv_block", "_kv_done", "_kv_failed") on the worker's command queue.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time

import torch

from contract.frames import ExportKV, ImportFailed, ImportKV, TransferDone
from runtime.transport.kv_rendezvous import open_group, secret_from_env

log = logging.getLogger(__name__)

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
TAG_STRIDE = 4096  # tags of a transfer: tag * TAG_STRIDE, then + 1 + block index
# the cache element types a header names: a block's bytes mean nothing in another type (an
# int8 cache's rows hold their scales, kernels/kv_int8.py), so the receiver checks them
CACHE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
MAX_DIMS = 6  # a block's dimensions a header has room for (runner.block_shape has 5)
HEADER_LEN = 3 + MAX_DIMS


def transfer_header(num_blocks: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """What a transfer starts with: its block count, each block's element type and shape."""
    dims = list(shape)
    return torch.tensor([num_blocks, CACHE_CODES[dtype], len(dims)]
                        + dims + [0] * (MAX_DIMS - len(dims)), dtype=torch.int64)


def header_mismatch(header: torch.Tensor, num_blocks: int, shape,
                    dtype: torch.dtype) -> str | None:
    """Why the sender's blocks cannot be written into this worker's cache (None: they can)."""
    if int(header[0]) != num_blocks:  # the sender had dropped the request
        return f"the prefill worker sent {int(header[0])} blocks, not {num_blocks}"
    if torch.equal(header, transfer_header(num_blocks, shape, dtype)):
        return None
    names = {code: str(t).removeprefix("torch.") for t, code in CACHE_CODES.items()}
    theirs = tuple(header[3:3 + int(header[2])].tolist())
    return (f"the prefill worker's KV blocks are {names.get(int(header[1]), '?')} {theirs}, "
            f"this worker's {names[CACHE_CODES[dtype]]} {tuple(shape)}: the workers of a "
            f"deployment need one --kv-cache-dtype")


class KVTransport:
    """Point-to-point block transfers between worker processes, on two threads."""

    def __init__(self, store_address: str, post, secret: str | None = None):
        host, port = store_address.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.secret = secret or secret_from_env()
        self.post = post  # puts an internal message on the worker's command queue
        self._store: torch.distributed.TCPStore | None = None
        self._groups: dict[str, tuple] = {}  # pair key -> (group, its sealed store)
        self._lock = threading.Lock()
        self.sends: queue.Queue = queue.Queue()
        self.recvs: queue.Queue = queue.Queue()
        for target, name in ((self._send_loop, "kv-send"), (self._recv_loop, "kv-recv")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def group(self, key: str, rank: int):
        """The two-rank group of a (prefill, decode) pair; blocks until the peer joins."""
        import torch.distributed as dist
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=GROUP_TIMEOUT)
            store = self._store
        entry = self._groups.get(key)
        if entry is None:
            entry = open_group(store, self.secret, key, rank, self.host, GROUP_TIMEOUT)
            self._groups[key] = entry
        return entry[0]

    def drop(self, key: str) -> None:
        self._groups.pop(key, None)

    def send(self, request_id: str, key: str, tag: int, blocks: list[torch.Tensor]) -> None:
        self.sends.put((request_id, key, tag, blocks))

    def recv(self, request_id: str, key: str, tag: int, num_blocks: int, shape, dtype) -> None:
        self.recvs.put((request_id, key, tag, num_blocks, shape, dtype))

    def _send_loop(self) -> None:
        while True:
            request_id, key, tag, blocks = self.sends.get()
            try:
                pg = self.group(key, 0)
                header = (transfer_header(len(blocks), blocks[0].shape, blocks[0].dtype)
                          if blocks else transfer_header(0, (), torch.float32))
                pg.send([header], 1, tag * TAG_STRIDE).wait(GROUP_TIMEOUT)
                works = [pg.send([block.contiguous()], 1, tag * TAG_STRIDE + 1 + i)
                         for i, block in enumerate(blocks)]  # all posted: a pipeline
                for work in works:
                    work.wait(GROUP_TIMEOUT)
                self.post({"type": "_kv_sent", "id": request_id})
            except Exception as exc:  # noqa: BLE001 - the peer died; the group is broken
                log.error("sending KV of %s failed: %s", request_id, exc)
                self.drop(key)

    def _recv_loop(self) -> None:
        while True:
            request_id, key, tag, num_blocks, shape, dtype = self.recvs.get()
            start, nbytes = time.time(), 0
            try:
                pg = self.group(key, 1)
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                pg.recv([header], 0, tag * TAG_STRIDE).wait(GROUP_TIMEOUT)
                mismatch = header_mismatch(header, num_blocks, shape, dtype)
                if mismatch:
                    raise RuntimeError(mismatch)
                bufs = [torch.empty(shape, dtype=dtype) for _ in range(num_blocks)]
                works = [pg.recv([buf], 0, tag * TAG_STRIDE + 1 + i)
                         for i, buf in enumerate(bufs)]
                for i, (buf, work) in enumerate(zip(bufs, works)):
                    work.wait(GROUP_TIMEOUT)  # block by block, written as each arrives
                    nbytes += buf.numel() * buf.element_size()
                    self.post({"type": "_kv_block", "id": request_id, "index": i, "kv": buf})
                self.post({"type": "_kv_done", "id": request_id, "blocks": num_blocks,
                           "bytes": nbytes, "start": start, "end": time.time()})
            except Exception as exc:  # noqa: BLE001 - the peer died, or gave the request up
                if "blocks, not" not in str(exc):  # a broken group is made afresh next time
                    self.drop(key)
                self.post({"type": "_kv_failed", "id": request_id, "error": str(exc)})


class Disagg:
    """The worker's disaggregation state: prefill-only requests, exports and imports."""

    def __init__(self, engine, transport: KVTransport | None, send):
        self.engine = engine
        self.transport = transport
        self.send = send  # writes one frame to the gateway
        self.prefill_only: set[str] = set()
        self.importing: dict[str, list[int]] = {}  # request id -> its block ids
        self.timing: dict[str, dict] = {}  # extra timing for a request's final output

    # ---- prefill side -----------------------------------------------------------------
    def after_step(self, messages: list[dict]) -> None:
        """Park each prefill-only request that has its first token; mark its output."""
        for m in messages:
            rid = m["id"]
            if rid not in self.prefill_only:
                continue
            if m["finished"]:
                self.prefill_only.discard(rid)  # ended at its first token: nothing to move
            elif m["tokens"] and self.engine.park_request(rid):
                m["prefilled"] = self.engine.request_timing(rid)

    def export(self, frame: ExportKV) -> None:
        rid = frame.id
        self.prefill_only.discard(rid)
        blocks = self.engine.export_request(rid)
        if self.transport is not None:  # an empty send tells the receiver to give up
            self.transport.send(rid, frame.key, frame.tag, blocks or [])

    # ---- decode side ------------------------------------------------------------------
    def import_(self, frame: ImportKV) -> None:
        rid = frame.id
        try:
            block_ids = self.engine.import_request(rid, frame.prompt, frame.output, frame.params,
                                                   frame.priority, frame.salt, frame.cached)
        except Exception as exc:  # noqa: BLE001 - refused like an add; the gateway fails it
            self.send(ImportFailed(rid, str(exc)))
            return
        self.importing[rid] = block_ids
        self.timing[rid] = dict(frame.timing or {})
        runner = self.engine.runner
        self.transport.recv(rid, frame.key, frame.tag, len(block_ids), runner.block_shape,
                            runner.kv_dtype)

    def on_internal(self, message: dict) -> None:
        kind, rid = message["type"], message["id"]
        if kind == "_kv_block":
            block_ids = self.importing.get(rid)
            if block_ids is not None:  # else aborted meanwhile: the buffer is dropped
                self.engine.runner.write_block(block_ids[message["index"]], message["kv"])
        elif kind == "_kv_done":
            if self.importing.pop(rid, None) is not None and self.engine.finish_import(rid):
                self.timing.setdefault(rid, {})["kv_transfer"] = [message["start"],
                                                                  message["end"]]
                self.send(TransferDone(rid, message["blocks"], message["bytes"],
                                       message["end"] - message["start"], message["start"],
                                       message["end"]))
        elif kind == "_kv_failed" and self.importing.pop(rid, None) is not None:
            self.engine.abort_request(rid)  # frees its blocks; nothing was streamed yet
            self.timing.pop(rid, None)
            self.send(ImportFailed(rid, message["error"]))

    def abort(self, rid: str) -> None:
        self.importing.pop(rid, None)
        self.prefill_only.discard(rid)

    def decorate(self, m: dict) -> None:
        """Give a finished imported request's output the prefill side's times."""
        if m["finished"]:
            extra = self.timing.pop(m["id"], None)
            if extra and m.get("timing"):
                m["timing"].update(extra)
