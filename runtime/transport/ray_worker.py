"""A runtime worker as a Ray actor, for the gateway's cluster mode (`--ray-address`).

The actor runs the same `runtime.transport.worker.Worker` loop on a thread; frames that would cross
a pipe cross Ray calls instead: `push` queues commands in order (a one-thread concurrency
group), `pull` returns the frames written since the last call (waiting up to `timeout`
seconds for one). Ray places the actor (GPU resource requests where the device is CUDA) on
any node; every node needs this repository at the same path (PYTHONPATH is set by the gateway).
In PD mode the gateway's KV-transfer secret comes as `--kv-secret` in the actor's argv (a Ray
call argument, seen by no `ps`) and goes into the actor's own environment, where a pipe
worker finds it too.
"""
from __future__ import annotations

import os
import queue
import threading

import ray

from contract.frames import Frame, decode_frame


class _FrameQueue:
    """A worker's out stream whose frames wait in a queue for `pull`."""

    def __init__(self):
        self.frames: queue.Queue = queue.Queue()

    def write(self, data: bytes) -> None:
        self.frames.put(decode_frame(data[4:]))  # one frame per write (Worker.send)

    def flush(self) -> None:
        pass


class RayWorker:
    def __init__(self, argv: list[str]):
        from runtime.transport.kv_rendezvous import SECRET_ENV, pop_secret_flag
        from runtime.transport.worker import Worker, build_engine, model_defaults, parse_args
        argv, secret = pop_secret_flag(argv)
        if secret:
            os.environ[SECRET_ENV] = secret  # this actor's process is this worker's alone
        args = parse_args(argv)
        self.out = _FrameQueue()
        self.worker = Worker(build_engine(args), self.out)
        self.sampling_defaults = model_defaults(args)
        if args.kv_store:
            self.worker.enable_disagg(args.kv_store)
        self.thread = threading.Thread(target=self.worker.loop, daemon=True)
        self.thread.start()

    def ready(self) -> Frame:
        return self.worker.ready_message(self.sampling_defaults)

    @ray.method(concurrency_group="push")
    def push(self, frame: Frame) -> None:
        self.worker.commands.put(frame)

    @ray.method(concurrency_group="pull")
    def pull(self, timeout: float = 0.5) -> list[Frame]:
        frames = []
        try:
            frames.append(self.out.frames.get(timeout=timeout))
            while True:
                frames.append(self.out.frames.get_nowait())
        except queue.Empty:
            pass
        if not frames and not self.thread.is_alive():
            os._exit(1)  # the loop ended (shutdown): the actor ends, the gateway notices
        return frames


class KVStoreHost:
    """Hosts the TCPStore of KV-transfer groups on a cluster node, listening on the node's
    IP as Ray knows it (the address workers are told), not on every interface."""

    def __init__(self):
        from runtime.transport.kv_rendezvous import serve_store  # torch, in this actor only
        host = ray.util.get_node_ip_address()
        self.store = serve_store(host)
        self.address = f"{host}:{self.store.port}"

    def get_address(self) -> str:
        return self.address
