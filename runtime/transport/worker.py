"""A runtime worker: one engine, driven by gateways over typed frames (contract/frames.py).

`python -m runtime.transport.worker [--model PATH] [--device cpu] [--threads N] ...` is one
gateway's child: frames on stdin and stdout; logs go to stderr. `python -m runtime serve` runs
the same loop for many gateways over TCP (runtime/transport/serve.py). The loop knows no
transport: readers (a thread on stdin here, one per socket there) queue commands; the main
thread applies them between engine steps, so only it touches the engine, and sends frames
through a link (here `StreamLink`, any binary stream). A request the engine refuses after
admitting it (its grammar did not compile) goes back as a `Rejected` frame, like one refused at
once. A frame's sampling parameters arrive as a validated `SamplingParams`, rebuilt by the
frame decoder: a bad payload is a frame that cannot be read (this worker exits 1; a shared one
closes that gateway's connection). After each step the engine's prefix-cache events, when it
has them, go to every gateway as `KvEvents`. The end of stdin (the gateway went away) ends the
pipe worker.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from contract.engine_settings import add_worker_flags, check_on_this_host, settings_from_args
from contract.errors import (
    LOG_FORMAT,
    START_ERROR_EXIT,
    START_ERROR_PREFIX,
    RuntimeErrorBase,
    StartError,
    one_line,
)
from contract.frames import (
    AbortRequest,
    AddRequest,
    ExportKV,
    Frame,
    IdleStats,
    ImportKV,
    KvEvents,
    Output,
    Ready,
    Rejected,
    Shutdown,
    Step,
    encode_frame,
    read_frame_blocking,
)
from contract.gc_tuning import tune_gc_for_serving
from contract.outputs import RequestOutput, StepStats
from runtime.execution.device_stats import DeviceStats

IDLE_STATS_SECONDS = 1.0
log = logging.getLogger("runtime.transport.worker")


@dataclass(frozen=True)
class _Unreadable:
    """The reader thread's last command: the gateway sent a frame that cannot be read."""

    error: str


def output_message(out: RequestOutput) -> Output:
    u = out.usage
    logprobs = None
    if out.logprobs is not None:
        logprobs = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs]
    message: Output = {"id": out.request_id, "tokens": out.new_token_ids, "text": out.new_text,
                       "finished": out.finished, "reason": out.finish_reason,
                       "stop_reason": out.stop_reason,
                       "usage": [u.prompt_tokens, u.cached_tokens, u.completion_tokens],
                       "logprobs": logprobs, "timing": out.timing}
    if out.prompt_logprobs is not None:  # once per request: no key on every other output
        message["prompt_logprobs"] = [
            None if e is None else [e.token_id, e.logprob, e.rank, [list(t) for t in e.top]]
            for e in out.prompt_logprobs]
    return message


def stats_message(engine, stats: StepStats | None, device=None) -> dict:
    message = engine.snapshot()
    if device is not None:
        message.update(device.snapshot())
    if stats is not None:
        message.update(step_seconds=stats.seconds_busy, batch=stats.num_requests,
                       prefill_tokens=stats.num_prefill_tokens,
                       decode_tokens=stats.num_decode_tokens)
    return message


class StreamLink:
    """A gateway at the end of a binary stream (the pipe's stdout): every frame written
    whole, in order, at once."""

    prefix = ""  # request ids as the gateway sent them: a stream has one gateway

    def __init__(self, out_stream):
        self.out = out_stream

    def send(self, frame: Frame) -> None:
        self.write(encode_frame(frame))

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


class Worker:
    """The frame loop over one engine, for one gateway at the end of `out_stream`.
    runtime/transport/serve.py's subclass routes the same frames among many gateways."""

    def __init__(self, engine, out_stream=None):
        self.engine = engine
        self.link = StreamLink(out_stream) if out_stream is not None else None
        self.commands: queue.Queue = queue.Queue()
        self.running = True
        self.exit_code = 0
        self.device = DeviceStats(engine.info().get("device", "cpu"))
        self.disagg = None  # runtime.transport.disagg.Disagg when the worker may move KV

    def enable_disagg(self, store_address: str | None) -> None:
        from runtime.transport.disagg import Disagg, KVTransport
        transport = KVTransport(store_address, self.commands.put) if store_address else None
        self.disagg = Disagg(self.engine, transport, self.send)

    def send(self, frame: Frame) -> None:
        self.link.send(frame)

    # ---- where frames go: the one gateway here; runtime/transport/serve.py overrides these ----
    def send_step(self, messages: list[Output], stats: dict | None) -> None:
        self.send(Step(messages, stats))

    def send_rejected(self, request_id: str, error: dict) -> None:
        self.send(Rejected(request_id, error))

    def send_idle_stats(self, stats: dict) -> None:
        self.send(IdleStats(stats))

    def broadcast(self, frame: Frame) -> None:
        """A frame every gateway gets (the pipe has one)."""
        self.send(frame)

    # ---- greeting and KV events ---------------------------------------------------------
    def ready_message(self, sampling_defaults: dict | None = None) -> Ready:
        # the capacity lets gateways refuse a request that cannot fit before queueing it
        return Ready(pid=os.getpid(), tokenizer=self.engine.tokenizer.to_json(),
                     sampling_defaults=sampling_defaults or {},
                     kv_capacity_tokens=self.engine.kv_capacity_tokens, **self.engine.info())

    def greet(self, link, sampling_defaults: dict | None = None) -> None:
        """A gateway joins: the Ready frame, then the prefix cache's blocks now (one cleared
        KvEvents), when the engine keeps them. Events not yet drained are in that snapshot,
        so the caller drains them first: to the gateways already there (`publish_kv_events`),
        or away when there are none."""
        link.send(self.ready_message(sampling_defaults))
        snapshot = getattr(self.engine, "kv_snapshot", None)
        if snapshot is not None:
            state = snapshot()
            link.send(KvEvents(tuple(state.stored) if state is not None else (), (), True))

    def drain_kv_events(self) -> KvEvents | None:
        drain = getattr(self.engine, "drain_kv_events", None)
        return drain() if drain is not None else None

    def publish_kv_events(self) -> None:
        events = self.drain_kv_events()
        if events is not None:
            self.broadcast(events)

    # ---- commands -----------------------------------------------------------------------
    def read_commands(self, in_stream) -> None:
        """Queue every frame from the gateway. A frame that cannot be read ends the worker
        (exit 1): a worker whose reader died would look alive and ignore every command,
        while a dead one is noticed and replaced at once."""
        try:
            while True:
                frame = read_frame_blocking(in_stream)
                self.commands.put(frame if frame is not None else Shutdown())
                if frame is None or isinstance(frame, Shutdown):
                    return
        except Exception as exc:  # noqa: BLE001 - see above
            self.commands.put(_Unreadable(f"{type(exc).__name__}: {exc}"))

    def apply(self, command) -> None:
        """One command from the queue: a gateway frame, or (disaggregation) an internal
        message from the transfer threads."""
        match command:
            case AddRequest():
                self.add(command)
            case AbortRequest(id=request_id):
                self.abort(request_id)
            case Shutdown():
                self.running = False
            case _Unreadable(error=error):
                print(f"worker: unreadable frame from the gateway ({error}); exiting",
                      file=sys.stderr)
                self.running, self.exit_code = False, 1
            case ExportKV() | ImportKV() | dict() if self.disagg is not None:
                self.apply_disagg(command)

    def abort(self, request_id: str) -> None:
        final = self.engine.abort_request(request_id)
        if self.disagg is not None:
            self.disagg.abort(request_id)
        if final is not None:
            self.send_step(self.messages([final]), None)

    def apply_disagg(self, command) -> None:
        match command:
            case ExportKV():
                self.disagg.export(command)
            case ImportKV():
                self.disagg.import_(command)
            case dict():  # the transfer threads' results
                self.disagg.on_internal(command)

    def messages(self, outputs: list[RequestOutput]) -> list[Output]:
        messages = [output_message(o) for o in outputs]
        if self.disagg is not None:
            self.disagg.after_step(messages)
            for m in messages:
                self.disagg.decorate(m)
        return messages

    def add(self, frame: AddRequest) -> None:
        error = self.admit(frame)
        if error is not None:
            self.send_rejected(frame.id, error)

    def admit(self, frame: AddRequest) -> dict | None:
        """Give the request to the engine; the reason it was refused, if it was."""
        try:
            self.engine.add_request(frame.id, frame.prompt, frame.params, frame.priority,
                                    frame.salt)
            if frame.prefill_only and self.disagg is not None:
                self.disagg.prefill_only.add(frame.id)
        except (RuntimeErrorBase, TypeError, ValueError) as exc:
            return {"message": str(exc), "param": getattr(exc, "param", None),
                    "kind": type(exc).__name__}
        return None

    # ---- the loop -----------------------------------------------------------------------
    def stats(self, step: StepStats | None) -> dict:
        return stats_message(self.engine, step, self.device)

    def step(self) -> None:
        """One engine step, sent as its frames: a Rejected frame for each request refused
        after admission (its grammar did not compile), the Step, then the KV events."""
        outputs, stats = self.engine.step()
        for out in outputs:
            if out.error is not None:
                self.send_rejected(out.request_id, out.error)
        self.send_step(self.messages([o for o in outputs if o.error is None]),
                       self.stats(stats))
        self.publish_kv_events()

    def loop(self) -> None:
        last_stats = 0.0
        while self.running:
            busy = self.engine.has_unfinished_requests()
            try:
                message = self.commands.get(block=not busy, timeout=IDLE_STATS_SECONDS)
                self.apply(message)
                continue  # drain every pending command before the next step
            except queue.Empty:
                pass
            if self.engine.has_unfinished_requests():
                self.step()
            elif time.monotonic() - last_stats >= IDLE_STATS_SECONDS:
                last_stats = time.monotonic()
                self.publish_kv_events()  # an abort between steps may have freed blocks
                self.send_idle_stats(self.stats(None))
        self.engine.close()


def build_parser(prog: str = "python -m runtime.transport.worker") -> argparse.ArgumentParser:
    """The engine's flags, shared by the pipe worker and runtime/transport/serve.py."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    add_worker_flags(p)  # --device, --kv-cache-gb, ...: declared in contract/engine_settings.py
    p.add_argument("--kv-store", default=None,
                   help="HOST:PORT of the TCPStore for KV transfers (prefill/decode workers)")
    p.add_argument("--fake", action="store_true",
                   help="a deterministic fake engine (no model), for gateway tests")
    p.add_argument("--fake-step-ms", type=float, default=2.0,
                   help="simulated seconds of work per fake engine step, in milliseconds")
    p.add_argument("--fake-kv-blocks", type=int, default=4096,
                   help="the fake engine's KV blocks of 16 tokens (its reported capacity)")
    p.add_argument("--debug", action="store_true",
                   help="a start error's traceback too, not only its line")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_engine(args):
    settings = settings_from_args(args)
    if args.fake:
        return _fake_engine(args, settings)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from runtime.engine import LLMEngine
    return LLMEngine.from_model_path(args.model, settings.engine_config())


def _fake_engine(args, settings):
    """The fake engine with the settings it models: the context and the chat template (the
    real engine applies both itself, runtime/engine.py)."""
    from runtime.fake_engine import FakeEngine
    extra: dict = {}
    if settings.max_model_len:
        extra["max_model_len"] = settings.max_model_len
    if settings.chat_template:
        from contract.tokenizer import load_chat_template
        from runtime.loading.gguf import read_gguf_tokenizer
        from runtime.loading.loader import default_model_path
        extra["tokenizer"] = read_gguf_tokenizer(default_model_path()).with_chat_template(
            load_chat_template(settings.chat_template))
    return FakeEngine(step_seconds=args.fake_step_ms / 1000,
                      max_num_seqs=settings.max_num_seqs, num_blocks=args.fake_kv_blocks,
                      **extra)


def start_engine(args):
    """(engine, the model's sampling defaults); a StartError (or any error: one at start is
    not cured by a restart) is reported in one line after START_ERROR_PREFIX, its traceback
    only with --debug, and ends the process with START_ERROR_EXIT."""
    started = time.monotonic()
    try:
        check_on_this_host(settings_from_args(args), fake=args.fake)  # before seconds of loading
        engine = build_engine(args)
        defaults = model_defaults(args)
    except Exception as exc:  # noqa: BLE001 - every kind becomes the one line the gateway reports
        if args.debug:
            traceback.print_exc()
        print(f"{START_ERROR_PREFIX}{_start_error_line(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(START_ERROR_EXIT) from None
    info = engine.info()
    weights = info.get("quantization") or "none"
    log.info("worker pid %d ready in %.1f s: %s on %s, %s weights, context %d, %d KV blocks",
             os.getpid(), time.monotonic() - started, info.get("model"), info.get("device"),
             "float" if weights == "none" else weights, info.get("max_model_len", 0),
             info.get("num_blocks", 0))
    return engine, defaults


def _start_error_line(exc: Exception) -> str:
    if isinstance(exc, StartError):
        return one_line(exc)
    return f"worker cannot start: {type(exc).__name__}: {one_line(exc)} (--debug shows where)"


def model_defaults(args) -> dict:
    """The model's sampling defaults (the fake engine has no model: OpenAI's)."""
    if args.fake:
        return {}
    from contract.model_files import default_model_path
    from runtime.loading.sampling_defaults import model_sampling_defaults
    return model_sampling_defaults(args.model or default_model_path())


def main(argv=None) -> int:
    args = parse_args(argv)
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nothing but frames may reach the gateway's pipe, not even C-level prints
    sys.stdout = sys.stderr
    # the gateway copies this stderr into its own log, line by line: the same format there
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    frames_in = os.fdopen(0, "rb")
    engine, defaults = start_engine(args)
    worker = Worker(engine, frames_out)
    if args.kv_store:
        worker.enable_disagg(args.kv_store)
    worker.drain_kv_events()  # a fresh engine's: the snapshot in the greeting holds them
    worker.greet(worker.link, defaults)
    tune_gc_for_serving()
    threading.Thread(target=worker.read_commands, args=(frames_in,), daemon=True).start()
    worker.loop()
    return worker.exit_code


if __name__ == "__main__":
    sys.exit(main())
