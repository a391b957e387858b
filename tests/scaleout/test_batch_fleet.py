"""Two gateways on one PostgreSQL (--state-url) share the Batch API's store: either one
answers for a batch the other runs, and when the gateway running a batch is SIGKILLed the
other takes it over once its lease runs out and completes it, every line exactly once in the
output and exactly one billed ledger row per line."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import asyncpg
import openai
import pytest

from gateway.batch.line_run import engine_request_id
from gateway.batch.runner import owner_name
from testkit.gateway_server import GatewayProcess
from testkit.services.postgres import postgres_server
from tests.gateway.batch_helpers import contents, jsonl, line, upload, wait_for

pytestmark = [pytest.mark.postgres]


def gateway(pg_url: str, ledger: str) -> GatewayProcess:
    return GatewayProcess("--fake", "--fake-step-ms", "5", "--max-num-seqs", "4",
                          "--ledger-path", ledger, "--state-url", pg_url,
                          "--batch-lease-seconds", "2")


async def owner_of(url: str, batch_id: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval("SELECT owner FROM batches WHERE id = $1", batch_id)
    finally:
        await conn.close()


async def ok_rows(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT id FROM requests WHERE id LIKE 'cmpl-batch%' AND "
                                "status = 'ok' AND cost_total > 0")
    finally:
        await conn.close()
    return [r["id"] for r in rows]


def test_the_other_gateway_takes_over_a_batch_whose_gateway_died(tmp_path):
    with postgres_server() as pg:
        ledgers = [str(tmp_path / name / "ledger.sqlite3") for name in "ab"]
        gws = [gateway(pg.url, path) for path in ledgers]
        try:
            clients = [openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
                       for g in gws]
            ids = [f"f{i}" for i in range(40)]
            f = upload(clients[0], jsonl([line(c, "/v1/completions", {
                "prompt": f"Fleet {c}", "max_tokens": 40}) for c in ids]))
            batch = clients[0].batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h")
            while clients[0].batches.retrieve(batch.id).request_counts.completed < 5:
                time.sleep(0.02)
            owner = asyncio.run(owner_of(pg.url, batch.id))
            dead = [owner_name(path) for path in ledgers].index(owner)
            alive = 1 - dead
            seen = clients[alive].batches.retrieve(batch.id)  # the other answers for it
            assert seen.status == "in_progress" and seen.request_counts.total == 40
            assert clients[alive].files.retrieve(f.id).bytes == \
                clients[dead].files.retrieve(f.id).bytes
            os.killpg(gws[dead].proc.pid, signal.SIGKILL)  # the gateway running it
            gws[dead].proc.wait()
            cb, b = clients[alive], gws[alive]
            done = wait_for(cb, batch.id, timeout=90)
            assert done.status == "completed" and done.request_counts.completed == 40
            out, errors = contents(cb, done)
            assert sorted(out) == sorted(ids) and errors == []
            b.stop()  # settlements flushed
            base = {engine_request_id("completion", batch.id, c, 0): c for c in ids}
            billed = Counter(base["-".join(rid.split("-")[:2])]
                             for rid in asyncio.run(ok_rows(pg.url)))
            assert billed == Counter(dict.fromkeys(ids, 1))
        finally:
            for g in gws:
                g.stop()
