"""The KV-capacity check at admission: a request whose prompt plus max_tokens no ready worker's
KV cache can hold (their Ready frames say how much) is refused before it is billed, queued or
sent, with the very status and body a worker's late refusal gives; a budget the client left to
the server is cut to what fits; with no worker's figure the check is left to the workers."""
from __future__ import annotations

import os
import signal

import pytest
import requests

from contract.frames import AddRequest, Ready, Rejected
from contract.sampling_params import SamplingParams
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightTable
from gateway.serving.queue import RequestQueue
from gateway.workers.handle import WorkerHandle
from testkit.gateway_server import GatewayProcess
from tests.runtime.test_serve import FrameClient, ServeProcess

BLOCKS = 8  # of 16 tokens: the shared worker holds 128 tokens per request
PROMPT = list(range(100, 200))  # 100 tokens


class _Proc:
    returncode = None
    pid = 4242


def _worker(index: int, capacity: int, ready: bool = True) -> WorkerHandle:
    w = WorkerHandle(index, [])
    w.proc = _Proc()
    w.info = Ready(pid=4242, model="m", max_model_len=4096, vocab_size=100, num_blocks=100,
                   block_size=16, max_num_seqs=4, device="cpu", eos_token_ids=[0],
                   tokenizer="", kv_capacity_tokens=capacity)
    if ready:
        w.ready.set()
    return w


def _dispatcher(workers: list[WorkerHandle]) -> Dispatcher:
    return Dispatcher(workers, RequestQueue(4), InFlightTable())


def test_the_capacity_is_the_largest_a_ready_worker_taking_requests_reports():
    assert _dispatcher([_worker(0, 128), _worker(1, 512)]).kv_capacity_tokens() == 512
    draining = _dispatcher([_worker(0, 128), _worker(1, 512)])
    draining.draining.add(1)
    assert draining.kv_capacity_tokens() == 128
    assert _dispatcher([_worker(0, 128, ready=False)]).kv_capacity_tokens() == 0
    assert _dispatcher([]).kv_capacity_tokens() == 0
    assert _dispatcher([_worker(0, 0)]).kv_capacity_tokens() == 0  # not reported


@pytest.fixture(scope="module")
def small():
    """A shared fake worker with a small KV cache, and a gateway on it alone."""
    serve = ServeProcess("--fake", "--fake-step-ms", "2", "--fake-kv-blocks", str(BLOCKS))
    gateway = None
    try:
        gateway = GatewayProcess("--fake", "--workers", "0", "--worker-url", serve.url)
        yield serve, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        serve.stop()


def complete(gateway: GatewayProcess, **body) -> requests.Response:
    return requests.post(gateway.url + "/v1/completions", json={"prompt": PROMPT, **body},
                         timeout=20)


def test_a_request_over_the_kv_capacity_is_refused_at_admission(small):
    serve, gateway = small
    os.kill(serve.proc.pid, signal.SIGSTOP)  # a request sent there would get no answer now
    try:
        r = complete(gateway, max_tokens=50)
    finally:
        os.kill(serve.proc.pid, signal.SIGCONT)
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "prompt plus max_tokens (150 tokens) exceeds the KV cache capacity of "
                   f"{BLOCKS * 16} tokens",
        "type": "invalid_request_error", "param": "max_tokens", "code": None}}


def test_the_refusal_says_what_the_workers_late_refusal_says(small):
    serve, gateway = small
    client = FrameClient(serve.port)
    try:
        client.send(AddRequest("late", PROMPT, SamplingParams(max_tokens=50)))
        late = client.read_until(lambda f: isinstance(f, Rejected))
    finally:
        client.close()
    error = complete(gateway, max_tokens=50).json()["error"]
    assert (error["message"], error["param"]) == (late.error["message"], late.error["param"])


def test_what_fits_is_served_and_a_left_budget_is_cut_to_fit(small):
    _, gateway = small
    r = complete(gateway, max_tokens=BLOCKS * 16 - len(PROMPT))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 28
    r = complete(gateway)  # no max_tokens: the rest of the context would not fit the KV
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == BLOCKS * 16 - len(PROMPT)
    assert r.json()["choices"][0]["finish_reason"] == "length"
