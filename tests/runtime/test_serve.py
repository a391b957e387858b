"""The shared worker (`python -m runtime serve`) as gateways see it, by hand over TCP: a Ready
frame per connection, request ids kept apart per connection, a dropped connection's requests
aborted while the others stream on, the secret's handshake before any frame, a bad frame
ending its connection only, KV events to every connection and the state to a late one, and
the tiny model's greedy outputs over the network equal to the pipe worker's."""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from contract.frames import (
    HELLO_BYTES,
    MAC_BYTES,
    NONCE_BYTES,
    TOKEN_ENV,
    AbortRequest,
    AddRequest,
    Frame,
    IdleStats,
    KvEvents,
    Ready,
    Step,
    check_proof,
    encode_frame,
    parse_hello,
    proof,
    read_frame_blocking,
)
from contract.model_files import FAKE_MODEL_NAME
from contract.sampling_params import SamplingParams
from runtime.fake_engine import FakeEngine
from runtime.transport.worker import Worker
from testkit.gateway_server import free_port

SECRET = "a-shared-secret-of-some-length"
FAKE = ("--fake", "--fake-step-ms", "5", "--max-num-seqs", "16")
LONG = 3000  # tokens: far more than any test waits for


class ServeProcess:
    """A real `python -m runtime serve` on a loopback port, ready once it answers."""

    def __init__(self, *flags: str, host: str = "127.0.0.1", port: int | None = None,
                 token: str | None = None, wait: bool = True, ready_timeout: float = 180.0):
        self.port = port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.token = token
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if token is not None:
            env[TOKEN_ENV] = token
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "serve", "--host", host, "--port", str(self.port),
             *flags], env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        if wait:
            self.wait_ready(ready_timeout)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.stderr()}")
            try:
                FrameClient(self.port, self.token).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"serve did not become ready: {self.stderr()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class FrameClient:
    """One gateway's side of a connection, by hand: the handshake, then frames. Outputs
    read on the way to what a caller waits for are kept in `seen`, KV events in `kv`."""

    def __init__(self, port: int, token: str | None = None, timeout: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.stream = self.sock.makefile("rb")
        self.seen: dict[str, list[dict]] = {}
        self.kv: list[KvEvents] = []
        try:
            wants_token, nonce = parse_hello(self._read(HELLO_BYTES))
            if wants_token:
                mine = os.urandom(NONCE_BYTES)
                self.sock.sendall(mine + proof(token or "", b"gateway", nonce, mine))
                if not check_proof(token or "", b"worker", mine, nonce, self._read(MAC_BYTES)):
                    raise ConnectionError("the worker did not prove the secret")
            self.ready = self.next()
        except BaseException:
            self.close()
            raise
        assert isinstance(self.ready, Ready)

    def _read(self, size: int) -> bytes:
        data = self.stream.read(size)
        if len(data) < size:
            raise ConnectionError("the worker closed the connection")
        return data

    def send(self, frame: Frame) -> None:
        self.sock.sendall(encode_frame(frame))

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.send(AddRequest(request_id, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    def next(self) -> Frame:
        frame = read_frame_blocking(self.stream)
        if frame is None:
            raise ConnectionError("the worker closed the connection")
        if isinstance(frame, Step):
            for out in frame.outputs:
                self.seen.setdefault(out["id"], []).append(out)
        elif isinstance(frame, KvEvents):
            self.kv.append(frame)
        return frame

    def read_until(self, predicate, timeout: float = 60.0) -> Frame:
        """Frames until one satisfies predicate (steps keep coming while anything runs, so
        the deadline is the test's, not the socket's)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(frame := self.next()):
                return frame
        raise TimeoutError("the awaited frame did not come")

    def run(self, request_ids) -> dict[str, list[dict]]:
        """Outputs until every one of these requests finished; nothing else may arrive."""
        def done(rid):
            return bool(self.seen.get(rid)) and self.seen[rid][-1]["finished"]
        if not all(done(r) for r in request_ids):
            self.read_until(lambda _: all(done(r) for r in request_ids))
        assert set(self.seen) <= set(request_ids), f"foreign outputs: {set(self.seen)}"
        for rid in request_ids:
            assert [o["finished"] for o in self.seen[rid]].count(True) == 1
        return {r: self.seen[r] for r in request_ids}

    def stats_where(self, predicate, idle: bool = False) -> dict:
        """The first stats (of a Step, or an IdleStats where `idle`) that satisfy predicate."""
        def wanted(frame) -> bool:
            stats = frame.stats if isinstance(frame, IdleStats | Step) else None
            return bool(stats) and (not idle or isinstance(frame, IdleStats)) \
                and predicate(stats)
        return self.read_until(wanted).stats

    def outputs_of(self, request_id: str, count: int) -> list[dict]:
        """`count` more outputs of one request."""
        have = len(self.seen.get(request_id, []))
        if len(self.seen.get(request_id, [])) < have + count:
            self.read_until(lambda _: len(self.seen.get(request_id, [])) >= have + count)
        return self.seen[request_id][have:]

    def closed_by_worker(self, timeout: float = 30.0) -> bool:
        """The worker ends the connection within `timeout` (frames before the end are read
        and dropped); False when it is still open then."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if read_frame_blocking(self.stream) is None:
                    return True
        except TimeoutError:
            return False
        except ConnectionError:  # reset: it closed with our bytes unread
            return True
        return False

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


def ended(sock: socket.socket) -> bool:
    """The peer closed: an end of stream, or a reset (it closed with our bytes unread)."""
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def tokens(outs: list[dict]) -> list[int]:
    return [t for o in outs for t in o["tokens"]]


@pytest.fixture(scope="module")
def serve():
    server = ServeProcess(*FAKE)
    yield server
    server.stop()


# ---- many gateways, one engine ---------------------------------------------------------
def test_each_connection_gets_ready_and_only_its_own_outputs(serve):
    a, b = FrameClient(serve.port), FrameClient(serve.port)
    try:
        assert a.ready.model == b.ready.model == FAKE_MODEL_NAME
        assert a.ready.pid == b.ready.pid == serve.proc.pid
        prompt_a, prompt_b = list(range(100, 105)), list(range(200, 230))
        for i in range(3):  # the same ids on both connections, at once
            a.add(f"r{i}", prompt_a, 5 + i)
            b.add(f"r{i}", prompt_b, 9 + i)
        seen_a, seen_b = a.run(["r0", "r1", "r2"]), b.run(["r0", "r1", "r2"])
        for i in range(3):
            final_a, final_b = seen_a[f"r{i}"][-1], seen_b[f"r{i}"][-1]
            assert len(tokens(seen_a[f"r{i}"])) == final_a["usage"][2] == 5 + i
            assert len(tokens(seen_b[f"r{i}"])) == final_b["usage"][2] == 9 + i
            assert final_a["usage"][0] == len(prompt_a) and final_b["usage"][0] == len(prompt_b)
    finally:
        a.close()
        b.close()


def test_an_abort_reaches_only_its_own_connections_request(serve):
    a, b = FrameClient(serve.port), FrameClient(serve.port)
    try:
        a.add("x", [1, 2, 3], LONG)
        b.add("x", [1, 2, 3], LONG)
        a.outputs_of("x", 1)
        b.outputs_of("x", 1)
        a.send(AbortRequest("x"))
        assert a.run(["x"])["x"][-1]["reason"] == "abort"
        assert not any(o["finished"] for o in b.outputs_of("x", 5))  # b's "x" goes on
        b.send(AbortRequest("x"))
        assert b.run(["x"])["x"][-1]["reason"] == "abort"
    finally:
        a.close()
        b.close()


def test_a_dropped_connection_has_its_requests_aborted_and_blocks_freed(serve):
    observer, a, b = (FrameClient(serve.port) for _ in range(3))
    try:
        for i in range(3):
            a.add(f"a{i}", list(range(40)), LONG)
        b.add("b", list(range(40)), LONG)
        observer.stats_where(lambda s: s["running"] == 4)
        a.sock.shutdown(socket.SHUT_RDWR)  # as the kernel does for a killed gateway
        a.close()
        after = observer.stats_where(lambda s: s["running"] == 1)
        assert after["waiting"] == 0 and after["connections"] == 2
        assert not any(o["finished"] for o in b.outputs_of("b", 5))  # b streams on
        b.send(AbortRequest("b"))
        assert b.run(["b"])["b"][-1]["reason"] == "abort"
        idle = observer.stats_where(lambda s: True, idle=True)
        assert (idle["running"], idle["waiting"], idle["kv_blocks_used"]) == (0, 0, 0)
        assert observer.seen == {}  # the observer saw stats, never another's outputs
    finally:
        for client in (observer, a, b):
            client.close()


def test_a_frame_the_worker_cannot_read_ends_that_connection_only(serve):
    good = FrameClient(serve.port)
    try:
        good.add("g", [7, 8, 9], LONG)
        good.outputs_of("g", 1)
        for garbage in (b"\x00\x00\x00\x05hello",  # a length, then bytes that are not JSON
                        b"\xff\xff\xff\xff",  # a frame over the size limit
                        encode_frame(IdleStats({}))):  # a frame only a worker sends
            bad = FrameClient(serve.port)
            try:
                bad.sock.sendall(garbage)
                assert bad.closed_by_worker()
            finally:
                bad.close()
        assert serve.proc.poll() is None
        assert not any(o["finished"] for o in good.outputs_of("g", 3))
        good.send(AbortRequest("g"))
        good.add("h", [7, 8, 9], 4)
        assert len(tokens(good.run(["g", "h"])["h"])) == 4
    finally:
        good.close()


# ---- the secret ------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "short"])
def test_beyond_loopback_it_refuses_to_start_without_a_good_secret(token):
    server = ServeProcess(*FAKE, host="0.0.0.0", token=token, wait=False)
    try:
        assert server.proc.wait(120) != 0
        assert TOKEN_ENV in server.stderr()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def secret_serve():
    server = ServeProcess(*FAKE, host="0.0.0.0", token=SECRET)
    yield server
    server.stop()


def test_a_connection_without_the_secret_is_closed_before_any_frame(secret_serve):
    sneak = socket.create_connection(("127.0.0.1", secret_serve.port), timeout=30)
    try:
        wants_token, _ = parse_hello(sneak.recv(HELLO_BYTES, socket.MSG_WAITALL))
        assert wants_token
        # frames where the proof belongs: read as a (wrong) proof, never as a frame
        sneak.sendall(encode_frame(AddRequest("sneak", list(range(50)),
                                              SamplingParams(max_tokens=50))) * 4)
        assert ended(sneak)
    finally:
        sneak.close()
    with pytest.raises(ConnectionError):
        FrameClient(secret_serve.port, "not-the-shared-secret")
    with pytest.raises(ConnectionError):
        FrameClient(secret_serve.port, None)
    good = FrameClient(secret_serve.port, SECRET)
    try:
        idle = good.stats_where(lambda s: True, idle=True)
        assert idle["steps"] == 0 and idle["generation_tokens"] == 0  # "sneak" never ran
        good.add("ok", [1, 2, 3], 3)
        assert len(tokens(good.run(["ok"])["ok"])) == 3
    finally:
        good.close()


# ---- KV events -------------------------------------------------------------------------
def view(frames: list[KvEvents]) -> set[str]:
    """What a gateway keeps of a worker's blocks after these frames."""
    held: set[str] = set()
    for f in frames:
        if f.cleared:
            held = set()
        held = (held - set(f.removed)) | set(f.stored)
    return held


def test_kv_events_reach_every_connection_and_a_late_one_gets_the_state(serve):
    a, b = FrameClient(serve.port), FrameClient(serve.port)
    late = None
    try:
        for client in (a, b):  # right after Ready: the state, replacing any view
            greeting = client.next()
            assert isinstance(greeting, KvEvents) and greeting.cleared
        before = view(a.kv)
        prompt = [300 + x for x in os.urandom(40)]  # never seen: 2 full blocks of 16, new
        a.add("kv", prompt, 3)
        a.run(["kv"])
        steps = a.stats_where(lambda s: True, idle=True)["steps"]
        # a step's events come right after it, so before any idle stats that follow it
        b.stats_where(lambda s: s["steps"] >= steps, idle=True)
        assert len(view(a.kv) - before) >= 2
        late = FrameClient(serve.port)
        greeting = late.next()
        assert isinstance(greeting, KvEvents) and greeting.cleared
        assert view(a.kv) == view(b.kv) == set(greeting.stored)
    finally:
        for client in (a, b, late):
            if client is not None:
                client.close()


def test_the_pipe_worker_sends_kv_events_after_steps_and_the_state_in_its_greeting():
    engine = FakeEngine(step_seconds=0)
    out = io.BytesIO()
    worker = Worker(engine, out)
    worker.add(AddRequest("r", list(range(50, 90)), SamplingParams(max_tokens=3)))
    while engine.has_unfinished_requests():
        worker.step()
    worker.greet(worker.link)
    out.seek(0)
    frames = []
    while (frame := read_frame_blocking(out)) is not None:
        frames.append(frame)
    ready = next(i for i, f in enumerate(frames) if isinstance(f, Ready))
    events, greeting = frames[:ready], frames[ready + 1:]
    assert all(isinstance(f, Step | KvEvents) for f in events)
    assert any(isinstance(f, KvEvents) for f in events)
    assert len(greeting) == 1 and greeting[0].cleared
    assert view([f for f in events if isinstance(f, KvEvents)]) == set(greeting[0].stored)
    assert set(greeting[0].stored) == set(engine.kv_snapshot().stored)


# ---- the tiny model ----------------------------------------------------------------------
def _pipe_greedy(argv: list[str], prompts: dict[str, list[int]], n: int) -> dict[str, list]:
    proc = subprocess.Popen([sys.executable, "-m", "runtime.transport.worker", *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert isinstance(read_frame_blocking(proc.stdout), Ready)
        for rid, prompt in prompts.items():
            proc.stdin.write(encode_frame(AddRequest(rid, prompt, SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True))))
        proc.stdin.flush()
        seen: dict[str, list[int]] = {rid: [] for rid in prompts}
        done: set[str] = set()
        while done != set(prompts):
            frame = read_frame_blocking(proc.stdout)
            assert frame is not None, "the pipe worker ended"
            for o in frame.outputs if isinstance(frame, Step) else ():
                seen[o["id"]] += o["tokens"]
                if o["finished"]:
                    done.add(o["id"])
        return seen
    finally:
        proc.kill()
        proc.wait()


def test_tiny_model_greedy_outputs_over_the_network_equal_the_pipe_workers(tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--kv-cache-gb", "0.01", "--threads", "1"]
    prompts = {"p0": [5, 6, 7, 8, 9], "p1": list(range(20, 47)), "p2": [3] * 11}
    expected = _pipe_greedy(argv, prompts, 12)
    server = ServeProcess(*argv)
    clients = [FrameClient(server.port) for _ in range(2)]
    try:
        for client in clients:  # two gateways at once, batched together in one engine
            for rid, prompt in prompts.items():
                client.add(rid, prompt, 12)
        for client in clients:
            got = {rid: tokens(outs) for rid, outs in client.run(list(prompts)).items()}
            assert got == expected
    finally:
        for client in clients:
            client.close()
        server.stop()
