"""Two disaggregation-enabled workers in one process (threads), driven like the gateway does:
frames in through each worker's command queue, frames out collected per request."""
from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from unittest import mock

from contract.frames import Shutdown, decode_frame, frame_from_dict
from runtime.transport.kv_rendezvous import SECRET_ENV, new_secret, serve_store
from runtime.transport.worker import Worker


class FrameSink:
    """A worker's out stream: decodes frames and routes them to per-request queues."""

    def __init__(self):
        self.buffer = b""
        self.frames: queue.Queue = queue.Queue()

    def write(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 4:
            size = int.from_bytes(self.buffer[:4], "big")
            if len(self.buffer) < 4 + size:
                break
            # as plain dicts, the shape the tests read (the typed frame, then its fields)
            self.frames.put(dataclasses.asdict(decode_frame(self.buffer[4:4 + size])))
            self.buffer = self.buffer[4 + size:]

    def flush(self) -> None:
        pass

    def next(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            frame = self.frames.get(timeout=max(0.01, deadline - time.monotonic()))
            if predicate(frame):
                return frame


class Pair:
    """A prefill worker and a decode worker sharing a TCPStore and the gateway's secret (in
    the environment, as the gateway gives it), each on its own thread."""

    def __init__(self, make_engine):
        self.store = serve_store("127.0.0.1")
        self.secret = new_secret()
        address = f"127.0.0.1:{self.store.port}"
        self.sinks = {"p": FrameSink(), "d": FrameSink()}
        self.workers = {}
        for side in ("p", "d"):
            w = Worker(make_engine(), self.sinks[side])
            with mock.patch.dict(os.environ, {SECRET_ENV: self.secret}):
                w.enable_disagg(address)
            self.workers[side] = w
            threading.Thread(target=w.loop, daemon=True).start()
        self.tags = iter(range(1, 1 << 19))

    def put(self, side: str, message: dict) -> None:
        """A gateway frame, given as its dict: typed through the protocol's own decoder."""
        self.workers[side].commands.put(frame_from_dict(dict(message)))

    def outputs(self, side: str, timeout: float = 30.0):
        """Yield (frame type, output or frame) from a side's frames."""
        while True:
            frame = self.sinks[side].next(lambda f: True, timeout)
            if frame["type"] == "step":
                for out in frame["outputs"]:
                    yield "output", out
            elif frame["type"] != "stats":
                yield frame["type"], frame

    def prefill(self, rid: str, prompt: list[int], params: dict) -> dict:
        """Run the prefill stage; return the first output (marked "prefilled" unless the
        request ended at its first token)."""
        self.put("p", {"type": "add", "id": rid, "prompt": prompt, "params": params,
                       "prefill_only": True})
        for kind, out in self.outputs("p"):
            if kind == "output" and out["id"] == rid:
                return out
            if kind == "rejected":
                raise AssertionError(out)

    def handoff(self, rid: str, prompt: list[int], params: dict, first: dict,
                export: bool = True) -> tuple[str, int]:
        tag = next(self.tags)
        key = f"{id(self)}-{tag}"
        self.put("d", {"type": "import", "id": rid, "prompt": prompt,
                       "output": first["tokens"], "params": params, "cached": first["usage"][1],
                       "timing": first.get("prefilled"), "key": key, "tag": tag})
        if export:
            self.put("p", {"type": "export", "id": rid, "key": key, "tag": tag})
        return key, tag

    def decode_rest(self, rid: str) -> tuple[list[int], dict, dict]:
        """Tokens after the first, the final output and the transfer frame."""
        tokens, transfer = [], None
        for kind, out in self.outputs("d"):
            if kind == "transfer" and out["id"] == rid:
                transfer = out
            elif kind == "import_failed":
                raise AssertionError(out)
            elif kind == "output" and out["id"] == rid:
                tokens += out["tokens"]
                if out["finished"]:
                    return tokens, out, transfer

    def close(self) -> None:
        for w in self.workers.values():
            w.commands.put(Shutdown())
