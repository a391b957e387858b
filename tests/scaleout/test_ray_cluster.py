"""Cluster mode: a local Ray cluster on loopback, two CPU workers placed as Ray actors by the
gateway (`--ray-address`), serving requests; a killed actor is replaced through Ray."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess, free_port
from tests.scaleout.test_disagg_gateway import complete, wait_all_workers

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    proc = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "4", "--num-gpus", "0",
         "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    yield f"127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def serve(url: str, n: int = 4) -> list[dict]:
    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(complete(s, url, f"hello number {i}", 8)
                                          for i in range(n)))
    return asyncio.run(main())


def test_two_cpu_workers_on_a_local_ray_cluster(ray_cluster, tiny_model_dir):
    gw = GatewayProcess("--model", str(tiny_model_dir), "--kv-cache-gb", "0.01",
                        "--workers", "2", "--threads-per-worker", "1",
                        "--ray-address", ray_cluster, ready_timeout=180)
    try:
        pids = wait_all_workers(gw, timeout=180)
        assert len(set(pids)) == 2 and os.getpid() not in pids
        out = serve(gw.url)
        assert all(o["usage"]["completion_tokens"] == 8 for o in out)
        os.kill(pids[0], signal.SIGKILL)  # the actor dies; the gateway asks Ray for another
        new = wait_all_workers(gw, exclude=(pids[0],), timeout=180)
        assert new[1] == pids[1]
        assert all(o["usage"]["completion_tokens"] == 8 for o in serve(gw.url))
        assert gw.metric("inferstack:worker_restarts") >= 1
    finally:
        gw.stop()
        gw.proc.wait(60)


def test_disaggregated_workers_meet_through_ray(ray_cluster, tiny_model_dir):
    gw = GatewayProcess("--model", str(tiny_model_dir), "--kv-cache-gb", "0.01",
                        "--pd", "1:1", "--threads-per-worker", "1",
                        "--ray-address", ray_cluster, ready_timeout=180)
    try:
        wait_all_workers(gw, timeout=180)
        out = serve(gw.url)
        assert all(o["usage"]["completion_tokens"] == 8 for o in out)
        assert gw.metric("inferstack:kv_transfer_seconds_count") == len(out)
    finally:
        gw.stop()
        gw.proc.wait(60)
