"""The batch tier's durable store: files, batches, their lines and each line's result.

One class over two backends: SQLite by default (its own file beside the ledger, 0600 like
the ledger, WAL so a committed result survives the gateway being killed), PostgreSQL with
--state-url (the ledger's database: any gateway of a fleet serves a batch's status and takes a
batch over when the gateway running it died). The SQL is the same (gateway/batch/sql.py); a
backend only runs statements: `fetch` (rows as tuples), `execute` and `transaction`.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from billing.ledger import create_private
from gateway.batch import sql as q

Step = tuple[str, Sequence[Any], bool]  # (statement, arguments, many: a list of argument rows)


class Backend(Protocol):
    async def fetch(self, sql: str, *args: Any) -> list[tuple]: ...

    async def transaction(self, steps: list[Step]) -> None: ...

    async def close(self) -> None: ...


class SqliteBackend:
    """One connection, used by one thread at a time (a lock), off the event loop."""

    def __init__(self, path: str):
        create_private(path)
        self.db = sqlite3.connect(path, timeout=30, check_same_thread=False,
                                  isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(q.SCHEMA)
        self.lock = threading.Lock()

    def _fetch(self, sql: str, args: Sequence[Any]) -> list[tuple]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")  # RETURNING writes: one transaction each
            try:
                rows = self.db.execute(q.sqlite_sql(sql), args).fetchall()
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return rows

    def _transaction(self, steps: list[Step]) -> None:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args, many in steps:
                    if many:
                        self.db.executemany(q.sqlite_sql(sql), args)
                    else:
                        self.db.execute(q.sqlite_sql(sql), args)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    async def fetch(self, sql: str, *args: Any) -> list[tuple]:
        return await asyncio.to_thread(self._fetch, sql, args)

    async def transaction(self, steps: list[Step]) -> None:
        await asyncio.to_thread(self._transaction, steps)

    async def close(self) -> None:
        with self.lock:
            self.db.close()


class PostgresBackend:
    """An asyncpg pool on the ledger's database; the schema made on first use, once."""

    def __init__(self, url: str):
        self.url = url
        self.pool: Any = None
        self._ready = asyncio.Lock()

    async def _pool(self):
        async with self._ready:
            if self.pool is None:
                import asyncpg  # only with --state-url, as billing/store_factory.py does
                pool = await asyncpg.create_pool(self.url, min_size=0, max_size=4,
                                                 command_timeout=10)
                async with pool.acquire() as conn, conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                    await conn.execute(q.postgres_schema())
                self.pool = pool
        return self.pool

    async def fetch(self, sql: str, *args: Any) -> list[tuple]:
        pool = await self._pool()
        async with pool.acquire() as conn:
            return [tuple(r) for r in await conn.fetch(sql, *args)]

    async def transaction(self, steps: list[Step]) -> None:
        pool = await self._pool()
        async with pool.acquire() as conn, conn.transaction():
            for sql, args, many in steps:
                if many:
                    await conn.executemany(sql, args)
                else:
                    await conn.execute(sql, *args)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


SCHEMA_LOCK = 0x0BA7_C4ED  # gateways starting together create the batch tables once


def new_id(prefix: str) -> str:
    """An id that sorts by creation time (microseconds), then random: lists are newest first
    by (created_at, id), and created_at has whole seconds only, as OpenAI's objects do."""
    return f"{prefix}{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def batch_store_path(ledger_path: str) -> str:
    """The SQLite file of files and batches: its own, in the ledger's folder."""
    return os.path.join(os.path.dirname(os.path.abspath(ledger_path)), "batches.sqlite3")


def open_backend(ledger_path: str, state_url: str | None) -> Backend:
    return PostgresBackend(state_url) if state_url else SqliteBackend(batch_store_path(ledger_path))


class BatchStore:
    """Every read and write of the tier, each one statement or one transaction."""

    def __init__(self, backend: Backend):
        self.db = backend

    async def close(self) -> None:
        await self.db.close()

    # ---- files ----------------------------------------------------------------------
    async def put_file(self, file_id: str, tenant: str, purpose: str, filename: str,
                       content: bytes | bytearray, created_at: int) -> None:
        await self.db.transaction([(q.PUT_FILE, (file_id, tenant, purpose, filename,
                                                 len(content), created_at, content), False)])

    async def get_file(self, tenant: str, file_id: str) -> tuple | None:
        rows = await self.db.fetch(q.GET_FILE, file_id, tenant)
        return rows[0] if rows else None

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        rows = await self.db.fetch(q.FILE_CONTENT, file_id, tenant)
        return bytes(rows[0][0]) if rows else None

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        rows = await self.db.fetch(q.DELETE_FILE + " RETURNING id", file_id, tenant)
        return bool(rows)

    async def list_files(self, tenant: str, after: str, purpose: str, limit: int) -> list[tuple]:
        return await self.db.fetch(q.LIST_FILES, tenant, after, purpose, limit)

    # ---- batches --------------------------------------------------------------------
    async def create_batch(self, batch_id: str, tenant: str, key_sha256: str, endpoint: str,
                           input_file_id: str, window: str, created_at: int, expires_at: int,
                           metadata: str | None) -> None:
        await self.db.transaction([(q.CREATE_BATCH, (batch_id, tenant, key_sha256, endpoint,
                                                     input_file_id, window, created_at,
                                                     expires_at, metadata), False)])

    async def get_batch(self, tenant: str, batch_id: str) -> tuple | None:
        rows = await self.db.fetch(q.GET_BATCH, batch_id, tenant)
        return rows[0] if rows else None

    async def list_batches(self, tenant: str, after: str, limit: int) -> list[tuple]:
        return await self.db.fetch(q.LIST_BATCHES, tenant, after, limit)

    async def count_open(self, tenant: str) -> int:
        return int((await self.db.fetch(q.COUNT_OPEN, tenant))[0][0])

    async def move(self, batch_id: str, status: str, from_statuses: tuple[str, ...],
                   stamp: str, now: int, *extra: tuple[str, Any]) -> bool:
        """Move a batch to `status` only from `from_statuses`: True if this call moved it."""
        sql = q.move(status, from_statuses, stamp, tuple(c for c, _ in extra))
        return bool(await self.db.fetch(sql, batch_id, now, *(v for _, v in extra)))

    async def claim(self, owner: str, lease_seconds: float, now: float) -> list[tuple]:
        return await self.db.fetch(q.CLAIM, owner, now + lease_seconds, now)

    async def release(self, owner: str) -> None:
        await self.db.transaction([(q.RELEASE, (owner,), False)])

    # ---- lines and results ----------------------------------------------------------
    async def start_lines(self, batch_id: str, lines: list[tuple[str, int, str]],
                          rejects: list[tuple[int, str]], now: int) -> None:
        """Validation's outcome in one transaction: the runnable lines, the rejected ones,
        the total, and the move to in_progress (nothing of it if the move is not allowed)."""
        await self.db.transaction([
            (q.ADD_LINE, [(batch_id, c, n, body) for c, n, body in lines], True),
            (q.ADD_REJECT, [(batch_id, n, line) for n, line in rejects], True),
            (q.SET_TOTAL, (batch_id, len(lines) + len(rejects)), False),
            (q.move("in_progress", ("validating",), "in_progress_at"), (batch_id, now), False)])

    async def pending(self, batch_id: str, from_line: int, limit: int) -> list[tuple]:
        """(custom_id, line_no, body, attempt) of lines without a result, in input order."""
        return await self.db.fetch(q.PENDING, batch_id, from_line, limit)

    async def unfinished(self, batch_id: str) -> list[tuple]:
        return await self.db.fetch(q.UNFINISHED, batch_id)

    async def bump_attempt(self, batch_id: str, custom_id: str) -> int:
        rows = await self.db.fetch(q.BUMP_ATTEMPT, batch_id, custom_id)
        return int(rows[0][0]) if rows else 0

    async def record(self, batch_id: str, custom_id: str, line_no: int, failed: bool,
                     line: str) -> bool:
        """A line's result, written once: False when it already had one."""
        return bool(await self.db.fetch(q.RECORD, batch_id, custom_id, line_no, int(failed),
                                        line))

    async def record_many(self, batch_id: str, results: list[tuple[str, int, bool, str]]
                          ) -> None:
        """(custom_id, line_no, failed, line) of several lines at once, each written once."""
        rows = [(batch_id, c, n, int(f), line) for c, n, f, line in results]
        await self.db.transaction([(q.RECORD.removesuffix(" RETURNING custom_id"), rows, True)])

    async def results(self, batch_id: str) -> list[tuple]:
        return await self.db.fetch(q.RESULTS, batch_id)

    async def rejects(self, batch_id: str) -> list[tuple]:
        return await self.db.fetch(q.REJECTS, batch_id)

    async def lines_waiting(self) -> int:
        return int((await self.db.fetch(q.WAITING))[0][0])
