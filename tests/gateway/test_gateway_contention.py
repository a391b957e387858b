"""Queueing, priority, overload and worker death, on a fake engine with one request slot."""
import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--fake", "--fake-step-ms", "10", "--max-num-seqs", "1",
                            "--max-queue", "4", "--aging-seconds", "1000")
    yield server
    server.stop()


async def completion(session, url, priority, max_tokens=5, stream=False):
    body = {"prompt": "x", "max_tokens": max_tokens, "priority": priority, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.read(), time.monotonic()


def test_urgent_requests_finish_first_under_contention(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            blocker = asyncio.create_task(completion(s, gw.url, 5, max_tokens=30))
            await asyncio.sleep(0.1)  # the only slot is busy now
            lows = [asyncio.create_task(completion(s, gw.url, 5)) for _ in range(2)]
            await asyncio.sleep(0.05)
            urgent = asyncio.create_task(completion(s, gw.url, -5))
            results = await asyncio.gather(blocker, *lows, urgent)
        return results
    blocker, low1, low2, urgent = asyncio.run(main())
    assert all(r[0] == 200 for r in (blocker, low1, low2, urgent))
    # the urgent request preempted the low-priority blocker and overtook the queued lows
    assert urgent[3] < low1[3] and urgent[3] < low2[3]
    assert urgent[3] < blocker[3]
    assert json.loads(blocker[2])["usage"]["completion_tokens"] == 30  # resumed, unchanged


def test_full_queue_answers_429_with_retry_after(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(completion(s, gw.url, 0, max_tokens=20))
                     for _ in range(10)]
            return await asyncio.gather(*tasks)
    results = asyncio.run(main())
    rejected = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert rejected and len(served) >= 4  # the queue holds 4; one more may be running
    for _status, headers, body, _ in rejected:
        assert int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
    assert gw.metric("inferstack:gateway_queue_length") == 0


def test_killed_worker_fails_its_requests_then_recovers(gw):
    pid = json.loads(gw.get("/ready")[1])["worker_pids"][0]

    async def main():
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/completions",
                                json={"prompt": "x", "max_tokens": 5000, "stream": True})
            await resp.content.readline()
            os.kill(pid, signal.SIGKILL)
            rest = await resp.read()
            return rest
    rest = asyncio.run(main())
    assert b'"error"' in rest and rest.endswith(b"data: [DONE]\n\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, body = gw.get("/ready")
        if status == 200 and json.loads(body)["worker_pids"][0] not in (None, pid):
            break
        time.sleep(0.2)
    assert status == 200

    async def again():
        async with aiohttp.ClientSession() as s:
            return await completion(s, gw.url, 0)
    assert asyncio.run(again())[0] == 200
    assert gw.metric("inferstack:worker_restarts") == 1
