"""The batch tier below HTTP, in process: the SQLite store's writes once (results, files,
status moves), leases taken over only after they run out, the file owner-only; the queue
keeping batch lines behind every online request whatever their age; and the judgement of
idle capacity."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from gateway.batch.idle import idle_slots
from gateway.batch.lines import read_lines
from gateway.batch.store import BatchStore, SqliteBackend, batch_store_path
from gateway.serving.queue import QueueEntry, QueueFull, RequestQueue


def test_store_writes_once_and_leases_pass_only_when_run_out(tmp_path):
    async def main():
        path = batch_store_path(str(tmp_path / "ledger.sqlite3"))
        store = BatchStore(SqliteBackend(path))
        assert os.stat(path).st_mode & 0o077 == 0  # names tenants: the owner's only
        await store.put_file("file-1", "t", "batch", "in.jsonl", bytearray(b"x\n"), 1)
        assert await store.get_file("u", "file-1") is None  # another tenant: unknown
        await store.create_batch("b1", "t", "sha", "/v1/completions", "file-1", "24h", 1,
                                 100, None)
        await store.start_lines("b1", [("a", 1, "{}"), ("b", 2, "{}")], [(3, "{}")], 2)
        assert not await store.move("b1", "in_progress", ("validating",), "in_progress_at", 3)
        assert await store.record("b1", "a", 1, False, "first")
        assert not await store.record("b1", "a", 1, True, "second")  # once
        assert [r[:2] for r in await store.pending("b1", 0, 10)] == [("b", 2)]
        assert await store.bump_attempt("b1", "b") == 1
        row = await store.get_batch("t", "b1")
        assert row[6] == "in_progress" and row[16:] == (3, None, None, None, None, 1, 1)
        # owner A holds it; B gets it only once A's lease ran out
        assert [r[0] for r in await store.claim("A", 10, 1000.0)] == ["b1"]
        assert await store.claim("B", 10, 1005.0) == []
        assert [r[0] for r in await store.claim("A", 10, 1006.0)] == ["b1"]  # renewed
        assert [r[0] for r in await store.claim("B", 10, 1017.0)] == ["b1"]
        assert await store.claim("A", 10, 1018.0) == []
        await store.close()

    asyncio.run(main())


def test_read_lines_refuses_each_bad_line_alone():
    def check(kind, body):
        if body.get("bad"):
            from gateway.errors import bad_request
            raise bad_request("bad body", param="bad")

    content = (b'{"custom_id": "a", "url": "/v1/completions", "body": {}}\n'
               b'\n'
               b'{"custom_id": "a", "url": "/v1/completions", "body": {}}\n'
               b'{"custom_id": "c", "url": "/v1/completions", "body": {"bad": 1}}\n'
               b'[1]\n'
               b'{"custom_id": "d", "url": "/v1/completions", "method": "GET", "body": {}}\n'
               b'{"custom_id": "e", "url": "/v1/completions", "body": {}}')
    lines, refused = read_lines(content, "/v1/completions", check)
    assert [(ln.custom_id, ln.line_no) for ln in lines] == [("a", 1), ("e", 7)]
    assert [(n, code) for n, code, _, _ in refused] == [
        (3, "duplicate_custom_id"), (4, "invalid_request"), (5, "invalid_json_line"),
        (6, "invalid_request")]
    assert "param bad" in refused[1][3]


def _entry(rid: str, priority: int, arrival: float, batch: bool = False) -> QueueEntry:
    return QueueEntry(rid, priority, None, arrival=arrival, batch=batch)


def test_batch_lines_wait_behind_every_online_request_whatever_their_age():
    q = RequestQueue(3, aging_seconds=1.0)
    q.push(_entry("old-batch", 1001, arrival=0.0, batch=True))
    q.push(_entry("late-online", 1000, arrival=1e6))  # aged far less, and least urgent
    assert q.peek().request_id == "late-online"
    assert (q.online_waiting, q.batch_waiting) == (1, 1)
    q.push(_entry("b2", 1001, arrival=1.0, batch=True))
    displaced = q.push(_entry("online-2", 5, arrival=2e6))  # full: a batch line gives way
    assert displaced is not None and displaced.request_id == "b2"
    assert q.batch_waiting == 1 and q.online_waiting == 2
    try:
        q.push(_entry("b3", 1001, arrival=3.0, batch=True))
        raise AssertionError("a batch line displaced an online request")
    except QueueFull:
        pass


def _worker(index: int, slots: int, busy: int, blocks: int = 100, used: int = 0):
    return SimpleNamespace(index=index, alive=True, max_num_seqs=slots, free_slots=slots - busy,
                           num_blocks=blocks, free_blocks=blocks - used)


def test_idle_slots_leave_the_margin_and_yield_to_online_demand():
    queue = SimpleNamespace(online_waiting=0)
    fleet = SimpleNamespace(workers=[_worker(0, 8, 0), _worker(1, 8, 6)], draining=set())
    # 10 free of 16, two kept (10% rounded up), at most four starting at once
    assert idle_slots(fleet, queue, 0.1, 4, starting=0) == 4
    assert idle_slots(fleet, queue, 0.1, 4, starting=3) == 1
    assert idle_slots(fleet, queue, 0.5, 4, starting=0) == 2  # 10 free, 8 kept
    assert idle_slots(fleet, SimpleNamespace(online_waiting=1), 0.1, 4, starting=0) == 0
    full_kv = SimpleNamespace(workers=[_worker(0, 8, 0, used=95)], draining=set())
    assert idle_slots(full_kv, queue, 0.1, 4, starting=0) == 0
    fleet.draining = {0}
    assert idle_slots(fleet, queue, 0.1, 4, starting=0) == 1  # 2 free on worker 1, 1 kept
