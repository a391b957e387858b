"""The hardening defects that live below HTTP, each on the real class: a job that cannot be
encoded, a dispatch round that raises, per-choice seeds at the edges, queue positions at scale,
a worker fed a malformed frame, and what counts as a loopback address."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest

from contract.frames import Ready, encode_frame, read_frame_blocking
from contract.sampling_params import MAX_SEED, MIN_SEED, SamplingParams, choice_seed
from gateway.config import GatewayConfig, is_loopback_host, refuse_open_keyless
from gateway.http.browser_guard import host_of, is_loopback_name, is_loopback_origin
from gateway.openai.requests import GenerationRequest
from gateway.serving.dispatch import Dispatcher, DispatchFailed
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase
from gateway.serving.queue import QueueEntry, RequestQueue
from gateway.workers.handle import WorkerHandle


class _Pipe:
    """A worker's stdin that keeps what was written."""

    def __init__(self):
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


class _Proc:
    returncode = None
    pid = 4242

    def __init__(self):
        self.stdin = _Pipe()


def _ready_worker() -> WorkerHandle:
    w = WorkerHandle(0, [])
    w.proc = _Proc()
    w.info = Ready(pid=4242, model="m", max_model_len=64, vocab_size=100, num_blocks=100,
                   block_size=16, max_num_seqs=4, device="cpu", eos_token_ids=[0], tokenizer="")
    w.ready.set()
    return w


def _job(request_id: str, seed: int, n: int = 2) -> InFlightRequest:
    request = GenerationRequest("completion", None, None, (1, 2, 3), 4, {"seed": seed}, n=n)
    return InFlightRequest(request_id, request, [1, 2, 3], "", request.sampling_params(4), 0,
                           None)


def _enqueue(dispatcher: Dispatcher, rec: InFlightRequest) -> None:
    """What the service does: the record is queued, then handed to the dispatcher."""
    dispatcher.table.move(rec, Phase.QUEUED)
    dispatcher.enqueue(rec)


def test_a_job_whose_frame_cannot_be_encoded_fails_alone():
    """Before: the encoder raised after the first choice was counted in flight, the slot was
    lost for good, and the exception escaped into the caller (or killed the loop)."""
    async def main():
        worker = _ready_worker()
        dispatcher = Dispatcher([worker], RequestQueue(16), InFlightTable())
        bad, good = _job("bad", 1), _job("good", 5)
        bad.prompt = [1 << 70]  # past what orjson encodes: its frames cannot be written
        _enqueue(dispatcher, bad)
        _enqueue(dispatcher, good)
        with pytest.raises(DispatchFailed):
            await bad.assigned
        assert await good.assigned is worker
        assert set(worker.inflight) == {"good/0", "good/1"}  # nothing of "bad" was counted
        assert len(worker.proc.stdin.frames) == 2
        assert len(dispatcher.queue) == 0
        assert good.phase is Phase.DISPATCHED and bad.phase is Phase.QUEUED  # until settled
    asyncio.run(main())


def test_the_dispatch_loop_survives_a_failing_round():
    async def main():
        dispatcher = Dispatcher([_ready_worker()], RequestQueue(16), InFlightTable())
        real, calls = dispatcher.dispatch_ready, []

        def flaky():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in one round")
            return real()
        dispatcher.dispatch_ready = flaky
        stop = asyncio.Event()
        loop = asyncio.create_task(dispatcher.run(stop))
        await asyncio.sleep(0.3)
        assert not loop.done() and dispatcher.loop_errors == 1 and len(calls) > 2
        assert dispatcher.is_alive()
        stop.set()
        await loop
    asyncio.run(main())


@pytest.mark.parametrize("seed", [MAX_SEED, MAX_SEED - 3, MIN_SEED, -1, 0, 12345])
def test_choice_seeds_fit_the_generator_and_differ(seed):
    seeds = [choice_seed(seed, i) for i in range(8)]
    assert seeds[0] == seed and len(set(seeds)) == 8
    for s in seeds:
        assert MIN_SEED <= s <= MAX_SEED
        orjson.dumps(s)  # the frame encoder's range
        SamplingParams(seed=s)


def test_job_frames_carry_distinct_fitting_seeds_at_the_top_of_the_range():
    async def frames_of():
        return _job("j", MAX_SEED, n=8).add_messages()
    frames = [orjson.loads(encode_frame(f)[4:]) for f in asyncio.run(frames_of())]
    seeds = [f["params"]["seed"] for f in frames]
    assert seeds[0] == MAX_SEED and len(set(seeds)) == 8


def test_sampling_params_refuse_a_seed_outside_the_range():
    for seed in (MAX_SEED + 1, MIN_SEED - 1):
        with pytest.raises(Exception, match="seed"):
            SamplingParams(seed=seed)


class _CountingEntry(QueueEntry):
    """Counts how often the queue looks at whether an entry is still waiting."""

    reads = 0

    def __getattribute__(self, name):
        if name == "queued":
            type(self).reads += 1
        return super().__getattribute__(name)


def test_queue_positions_cost_one_ranking_not_a_scan_per_client():
    """1,024 queued WebSocket clients each polling their place: before, every poll scanned the
    whole line (about a million looks per round); now one ranking serves them all."""
    queue = RequestQueue(2048)
    entries = [_CountingEntry(f"r{i}", priority=i % 3, payload=None, arrival=float(i))
               for i in range(1024)]
    for e in entries:
        queue.push(e)
    _CountingEntry.reads = 0
    positions = [queue.position(e) for e in entries]
    assert _CountingEntry.reads < 4 * len(entries)
    order = sorted(entries, key=lambda e: e.key)
    assert positions == [order.index(e) for e in entries]


def test_a_malformed_frame_ends_the_worker():
    """Before: the frame killed only the reader thread; the worker looked alive and ignored
    every later command. Now it exits 1, so the gateway replaces it at once."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime.transport.worker", "--fake"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert isinstance(read_frame_blocking(proc.stdout), Ready)
        proc.stdin.write(b"\x00\x00\x00\x05hello")  # a length, then bytes that are not JSON
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("192.168.0.7", False)])
def test_which_listen_addresses_are_loopback(host, loopback):
    assert is_loopback_host(host) is loopback


def test_keyless_config_beyond_loopback_is_refused_unless_allowed():
    with pytest.raises(SystemExit, match="--keys-file"):
        refuse_open_keyless(GatewayConfig(host="0.0.0.0"))
    refuse_open_keyless(GatewayConfig(host="0.0.0.0", allow_insecure_no_auth=True))
    refuse_open_keyless(GatewayConfig(host="0.0.0.0", keys_file="keys.toml"))
    refuse_open_keyless(GatewayConfig(host="127.0.0.1"))


@pytest.mark.parametrize("header,ok", [
    ("localhost:8000", True), ("127.0.0.1", True), ("[::1]:8000", True), ("app.localhost", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.nip.io", False),
    ("localhost.evil.example", False)])
def test_loopback_host_headers(header, ok):
    assert is_loopback_name(host_of(header)) is ok


@pytest.mark.parametrize("origin,ok", [
    ("http://localhost:5173", True), ("https://127.0.0.1", True), ("http://[::1]:3000", True),
    ("null", False), ("http://evil.example", False), ("file://", False),
    ("http://localhost.evil.example", False)])
def test_loopback_origins(origin, ok):
    assert is_loopback_origin(origin) is ok
