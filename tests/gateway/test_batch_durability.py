"""A batch survives its gateway: SIGKILL mid-batch, restart on the same ledger, and the batch
completes with every line exactly once in the output and exactly one billed ledger row per
line (the rerun settles under the line's own id); then a batch past its window expires with
its finished lines delivered and the rest in the error file as expired."""
from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections import Counter

import openai

from gateway.batch.line_run import engine_request_id
from testkit.gateway_server import GatewayProcess
from tests.gateway.batch_helpers import contents, jsonl, ledger_rows, line, upload, wait_for

FLAGS = ("--fake", "--fake-step-ms", "5", "--max-num-seqs", "4")


def billed_lines(ledger: str, batch_id: str, custom_ids: list[str]) -> Counter:
    """custom_id -> its ledger rows with status ok (attempt suffixes folded in)."""
    base = {engine_request_id("completion", batch_id, c, 0): c for c in custom_ids}
    counts: Counter = Counter()
    for rid, status, cost in ledger_rows(ledger, "cmpl-batch"):
        custom_id = base.get(rid.split("-")[0] + "-" + rid.split("-")[1])
        if custom_id is not None and status == "ok":
            assert cost > 0
            counts[custom_id] += 1
    return counts


def test_sigkill_mid_batch_then_restart_runs_every_line_once(tmp_path):
    ledger = str(tmp_path / "ledger.sqlite3")
    gw = GatewayProcess(*FLAGS, "--ledger-path", ledger)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        ids = [f"k{i}" for i in range(40)]
        f = upload(client, jsonl([line(c, "/v1/completions", {"prompt": f"Kill {c}",
                                                               "max_tokens": 40})
                                  for c in ids]))
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 8:
            time.sleep(0.02)
        os.killpg(gw.proc.pid, signal.SIGKILL)  # the gateway and its worker, mid-batch
        gw.proc.wait()
        gw = GatewayProcess(*FLAGS, "--ledger-path", ledger)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        done = wait_for(client, batch.id, timeout=60)
        assert done.status == "completed" and done.request_counts.completed == 40
        out, errors = contents(client, done)
        assert sorted(out) == sorted(ids) and errors == []
        assert {e["response"]["body"]["usage"]["completion_tokens"] for e in out.values()} == {40}
        gw.stop()  # the ledger flushed
        assert billed_lines(ledger, batch.id, ids) == Counter(dict.fromkeys(ids, 1))
    finally:
        gw.stop()


def test_a_batch_past_its_window_expires_with_its_finished_lines(tmp_path):
    ledger = str(tmp_path / "ledger.sqlite3")
    gw = GatewayProcess(*FLAGS, "--ledger-path", ledger)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        ids = [f"e{i}" for i in range(30)]
        f = upload(client, jsonl([line(c, "/v1/completions", {"prompt": c, "max_tokens": 80})
                                  for c in ids]))
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            time.sleep(0.02)
        # the window ends now (24 hours are not waited for in a test)
        with sqlite3.connect(str(tmp_path / "batches.sqlite3")) as db:
            db.execute("UPDATE batches SET expires_at = 0 WHERE id = ?", (batch.id,))
        done = wait_for(client, batch.id)
        assert done.status == "expired" and done.expired_at is not None
        out, errors = contents(client, done)
        assert len(out) >= 3 and sorted(list(out) + [e["custom_id"] for e in errors]) == \
            sorted(ids)
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert done.request_counts.completed == len(out)
        assert done.request_counts.failed == len(errors)
    finally:
        gw.stop()
