"""Settlements the shared ledger could not take yet, kept on this machine's disk until it can.

A request that finished while PostgreSQL was unreachable is billed all the same: its
settlement (the ledger row and the reservation it replaces) goes into this SQLite file, in WAL
mode like the embedded ledger, and a background task replays it until PostgreSQL has it. The
replay is idempotent on the request id (billing/pg_sql.py, SETTLE), so a settlement
that reached PostgreSQL just before a crash and is replayed after a restart is not billed
twice. The file names tenants and money: it is the owner's only, like the ledger.
"""
from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import orjson

from billing.ledger import LedgerRow, create_private

SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, period TEXT NOT NULL, row TEXT,
    added REAL NOT NULL
)
"""


@dataclass(frozen=True)
class Settlement:
    """What moves one reservation in the shared store: with a row, SETTLE; without, RELEASE."""

    request_id: str
    tenant: str
    period: str
    row: LedgerRow | None


class SettlementOutbox:
    def __init__(self, path: str):
        self.path = path
        create_private(path)
        with self._connect() as db:
            db.execute(SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A connection of its own for each call, committed and closed after: calls run in
        worker threads, and only while the shared store is unreachable, so what they cost
        does not matter and no connection is shared between threads."""
        db = sqlite3.connect(self.path, timeout=30)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            with db:
                yield db
        finally:
            db.close()

    def add(self, s: Settlement) -> None:
        row = None if s.row is None else orjson.dumps(dataclasses.asdict(s.row)).decode()
        with self._connect() as db:
            db.execute("INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?, ?)",
                       (s.request_id, s.tenant, s.period, row, time.time()))

    def remove(self, request_id: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM pending WHERE id = ?", (request_id,))

    def load(self) -> list[Settlement]:
        """Every settlement waiting, oldest first."""
        with self._connect() as db:
            rows = db.execute("SELECT id, tenant, period, row FROM pending "
                              "ORDER BY added").fetchall()
        return [Settlement(i, tenant, period,
                           None if row is None else LedgerRow(**orjson.loads(row)))
                for i, tenant, period, row in rows]
