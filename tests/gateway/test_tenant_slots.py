"""A tenant's share of the running batch: a flood cannot starve another tenant's first token,
a key file's `max_running_share` caps a tenant while others wait, a lone tenant has it all.

Times are read on the client as multiples of the fake engine's step, never as absolute
wall-clock bounds: the fake emits one token per running request per step.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from testkit.gateway_server import GatewayProcess
from tests.gateway.keyfile import write_key_file

STEP_MS = 10
SLOTS = 8  # --max-num-seqs on the one worker
TENANTS = {"flood": {}, "other": {}, "whole": {"max_running_share": 1.0},
           "capped": {"max_running_share": 0.25}, "ops": {}}
KEYS = [("sk-flood", "flood", False, False), ("sk-other", "other", False, False),
        ("sk-whole", "whole", False, False), ("sk-capped", "capped", False, False),
        ("sk-admin", "ops", True, False)]


class _Gateway(GatewayProcess):
    admin_key = "sk-admin"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    keys = write_key_file(tmp_path_factory.mktemp("slots") / "keys.toml", TENANTS, KEYS)
    server = _Gateway("--fake", "--fake-step-ms", str(STEP_MS), "--max-num-seqs", str(SLOTS),
                      "--keys-file", keys, "--max-queue", "1024")
    yield server
    server.stop()


async def stream(session, url: str, key: str, max_tokens: int) -> dict:
    """One streamed completion: when it was sent, its first and last token on arrival here,
    and the tokens its usage reports."""
    body = {"prompt": "share the batch", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    rec = {"sent": time.monotonic(), "first": None, "end": None, "tokens": None}
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b'data: {"id"') and b'"text":"' in line \
                    and b'"text":""' not in line:
                rec["first"] = rec["first"] or time.monotonic()
                rec["end"] = time.monotonic()
            if b'"usage":{' in line and b'"choices":[]' in line:
                rec["tokens"] = int(line.split(b'"completion_tokens":')[1].split(b",")[0])
    return rec


async def wait_slots(gw: _Gateway, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while gw.metric("inferstack:worker_slots_in_use") < n:
        assert time.monotonic() < deadline, "the flood never filled the slots"
        await asyncio.to_thread(time.sleep, STEP_MS / 1000)


def running_at(recs: list[dict], t: float) -> int:
    """How many of `recs` had their first token and not yet their last at time t."""
    return sum(1 for r in recs if r["first"] is not None and r["first"] <= t < r["end"])


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=120))


def test_a_flood_does_not_starve_another_tenants_first_token(gw):
    """Before: 64 streams of one tenant held all 8 slots and the other's first token waited
    for one of them to finish (about 45 of their 60 steps). Now it is admitted by preempting
    the tenant over its share: its first token comes within a few steps."""
    async def main():
        async with session() as s:
            flood = [asyncio.create_task(stream(s, gw.url, "sk-flood", 60))
                     for _ in range(SLOTS * 8)]
            await wait_slots(gw, SLOTS)
            await asyncio.sleep(15 * STEP_MS / 1000)  # the flood is well into its decode
            other = await stream(s, gw.url, "sk-other", 4)
            return other, await asyncio.gather(*flood)
    other, flood = asyncio.run(main())
    ttft_steps = (other["first"] - other["sent"]) * 1000 / STEP_MS
    assert ttft_steps <= 6, f"the other tenant's first token took {ttft_steps:.1f} steps"
    assert other["tokens"] == 4
    assert [r["tokens"] for r in flood] == [60] * len(flood)  # preempted, never lost


def test_the_key_files_share_caps_a_tenant_while_others_wait(gw):
    """`capped` (max_running_share 0.25: 2 of 8 slots) runs at most 2 streams while `whole`
    (1.0) still has requests waiting, and more once nobody else waits."""
    async def main():
        async with session() as s:
            whole = [asyncio.create_task(stream(s, gw.url, "sk-whole", 20))
                     for _ in range(SLOTS * 3)]
            await wait_slots(gw, SLOTS)
            capped = [asyncio.create_task(stream(s, gw.url, "sk-capped", 20))
                      for _ in range(SLOTS + 4)]
            return await asyncio.gather(*whole), await asyncio.gather(*capped)
    whole, capped = asyncio.run(main())
    assert all(r["tokens"] == 20 for r in whole + capped)
    last_whole_start = max(r["first"] for r in whole)  # until then, `whole` had some waiting
    contended = [running_at(capped, r["first"]) for r in capped
                 if r["first"] < last_whole_start]
    assert contended and max(contended) == 2, contended
    assert max(running_at(capped, r["first"]) for r in capped) > 2  # work-conserving


def test_a_lone_tenant_uses_the_whole_batch(gw):
    async def main():
        async with session() as s:
            return await asyncio.gather(*(stream(s, gw.url, "sk-flood", 20)
                                          for _ in range(SLOTS * 2)))
    recs = asyncio.run(main())
    assert all(r["tokens"] == 20 for r in recs)
    assert max(running_at(recs, r["first"]) for r in recs) == SLOTS


def test_the_gateways_default_share_reaches_the_dispatcher(tmp_path):
    from gateway.app import create_app
    from gateway.config import load_config
    from gateway.state import STATE
    config = load_config(["--fake", "--tenant-max-running-share", "0.25", "--ledger-path",
                          str(tmp_path / "ledger.sqlite3")], environ={})
    assert create_app(config)[STATE].dispatcher.tenant_max_running_share == 0.25
