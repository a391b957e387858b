"""Helpers of the Batch API tests: a JSONL of requests, a batch run to its end through the
openai client, and the ledger's rows of a batch's lines."""
from __future__ import annotations

import io
import json
import sqlite3
import time

import openai


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def upload(client: openai.OpenAI, content: bytes, name: str = "input.jsonl"):
    return client.files.create(file=(name, io.BytesIO(content)), purpose="batch")


def wait_for(client: openai.OpenAI, batch_id: str, statuses=("completed", "failed", "expired",
                                                             "cancelled"), timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def run_batch(client: openai.OpenAI, endpoint: str, lines: list[dict], timeout=60.0):
    """Upload, create, poll to the end; (batch, output lines by custom_id, error lines)."""
    f = upload(client, jsonl(lines))
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h", metadata={"test": "yes"})
    assert batch.status == "validating"
    batch = wait_for(client, batch.id, timeout=timeout)
    return (batch, *contents(client, batch))


def contents(client: openai.OpenAI, batch) -> tuple[dict, list[dict]]:
    out: dict = {}
    if batch.output_file_id:
        for raw in client.files.content(batch.output_file_id).text.splitlines():
            entry = json.loads(raw)
            assert entry["custom_id"] not in out, "a line delivered twice"
            out[entry["custom_id"]] = entry
    errors = []
    if batch.error_file_id:
        errors = [json.loads(raw)
                  for raw in client.files.content(batch.error_file_id).text.splitlines()]
    return out, errors


def ledger_rows(path: str, prefix: str) -> list[tuple]:
    """(id, status, cost_total) of the ledger rows whose id starts with `prefix`."""
    with sqlite3.connect(path) as db:
        return db.execute("SELECT id, status, cost_total FROM requests WHERE id LIKE ?",
                          (prefix + "%",)).fetchall()
