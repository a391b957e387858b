"""The durable ledger: one SQLite row (WAL mode) for every finished request.

Rows are written by one background thread, so the event loop never waits on the disk.
`record()` returns an asyncio future that the writer resolves once the row is committed (rows
are committed in batches, one future callback per batch), so an answer can wait for its row:
with WAL, a committed row survives the gateway being killed. `flush()` waits until every
queued row is committed. Reads use their own connection.

A row is written once per request id: a second row with an id the ledger already holds (a
batch line run again after a crash, a settlement retried) changes nothing, and its future
resolves with False instead of True, so the budget can take back what it counted for it.

The ledger names tenants and what they spent, so its files are the owner's only (0600):
SQLite gives the -wal and -shm files the database file's mode, so that file is created 0600
before SQLite first opens it.
"""
from __future__ import annotations

import asyncio
import logging
import operator
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, fields

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_name TEXT, model TEXT,
    created REAL NOT NULL, finished REAL NOT NULL, priority INTEGER,
    cache_hit_tokens INTEGER NOT NULL, cache_miss_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost_cache_hit REAL NOT NULL, cost_cache_miss REAL NOT NULL, cost_output REAL NOT NULL,
    cost_total REAL NOT NULL, price_multiplier REAL NOT NULL,
    queue_seconds REAL, ttft_seconds REAL, e2e_seconds REAL,
    finish_reason TEXT, status TEXT NOT NULL, kind TEXT,
    tier TEXT NOT NULL DEFAULT 'online', batch_id TEXT
);
CREATE INDEX IF NOT EXISTS requests_tenant_finished ON requests (tenant, finished);
"""
# columns added since the first schema, for ledgers written before them: (name, SQL type).
# Each is appended, so a table's column order stays LedgerRow's field order (rows are
# inserted by position)
ADDED_COLUMNS = (("kind", "TEXT"), ("tier", "TEXT NOT NULL DEFAULT 'online'"),
                 ("batch_id", "TEXT"))
# the APIs a request may come through, as the ledger's `kind` names them
KINDS = ("chat", "completions", "responses", "messages")

# the columns of `totals`, whichever ledger answers
TOTALS_NAMES = ("tenant", "period", "requests", "cache_hit_tokens", "cache_miss_tokens",
                "output_tokens", "cost_cache_hit", "cost_cache_miss", "cost_output",
                "cost_total", "batch_requests", "cost_batch")

PERIOD_FORMATS = {"hour": "%Y-%m-%dT%H:00", "day": "%Y-%m-%d", "month": "%Y-%m", "all": "all"}


@dataclass(frozen=True)
class LedgerRow:
    id: str
    tenant: str
    key_name: str | None
    model: str | None
    created: float  # unix seconds
    finished: float
    priority: int
    cache_hit_tokens: int
    cache_miss_tokens: int
    output_tokens: int
    cost_cache_hit: float
    cost_cache_miss: float
    cost_output: float
    cost_total: float
    price_multiplier: float
    queue_seconds: float | None
    ttft_seconds: float | None
    e2e_seconds: float | None
    finish_reason: str | None
    status: str  # "ok", "cancelled", "error", "rejected"
    kind: str | None = None  # the API it came through (KINDS); None: not known (older rows)
    tier: str = "online"  # billing.pricing.TIERS: "batch" for a line of a Batch API job
    batch_id: str | None = None  # that job's id


class Ledger:
    def __init__(self, path: str):
        self.path = path
        create_private(path)
        with self._connect() as db:
            db.executescript(SCHEMA)
            present = {r[1] for r in db.execute("PRAGMA table_info(requests)")}
            for name, kind in ADDED_COLUMNS:
                if name not in present:
                    db.execute(f"ALTER TABLE requests ADD COLUMN {name} {kind}")
        self._rows: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ledger-writer",
                                        daemon=True)
        self._writer.start()
        self.rows_written = 0

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # ---- writes -------------------------------------------------------------------------
    def record(self, row: LedgerRow) -> asyncio.Future | None:
        """Queue a row; the future (None outside an event loop) resolves once it is committed:
        True, or False when the ledger already held a row of that id (nothing written)."""
        try:
            future = asyncio.get_running_loop().create_future()
        except RuntimeError:
            future = None
        self._rows.put((row, future))
        return future

    def flush(self, timeout: float = 30.0) -> None:
        done = threading.Event()
        self._rows.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._rows.put(None)
        self._writer.join(timeout=30)

    def _write_loop(self) -> None:
        db = self._connect()
        names = [f.name for f in fields(LedgerRow)]
        marks = ",".join("?" * len(names))
        as_tuple = operator.attrgetter(*names)  # dataclasses.astuple deep-copies: 10x slower
        while True:
            item = self._rows.get()
            batch = [item]
            while not self._rows.empty() and len(batch) < 512:
                batch.append(self._rows.get_nowait())
            entries = [r for r in batch if isinstance(r, tuple)]
            if entries:
                try:
                    with db:
                        fresh = _insert_new(db, f"INSERT INTO requests VALUES ({marks})",
                                            [as_tuple(row) for row, _ in entries])
                    self.rows_written += sum(fresh)
                    _resolve([(f, new) for (_, f), new in zip(entries, fresh)
                              if f is not None], None)
                except sqlite3.Error as exc:  # the waiting answers report it; keep writing
                    log.error("ledger write of %d rows failed: %s", len(entries), exc)
                    _resolve([(f, False) for _, f in entries if f is not None], exc)
            for r in batch:
                if isinstance(r, threading.Event):
                    r.set()
            if any(r is None for r in batch):
                db.close()
                return

    # ---- reads --------------------------------------------------------------------------
    def spent_since(self, tenant: str, since: float) -> float:
        with self._connect() as db:
            (total,) = db.execute("SELECT COALESCE(SUM(cost_total), 0) FROM requests "
                                  "WHERE tenant = ? AND created >= ?", (tenant, since)).fetchone()
        return float(total)

    def totals(self, period: str = "day", since: float | None = None,
               until: float | None = None, tenant: str | None = None) -> list[dict]:
        """Sums per tenant and period bucket (hour, day, month or all), newest first; of
        them, the batch tier's requests and dollars (`batch_requests`, `cost_batch`)."""
        fmt = PERIOD_FORMATS[period]
        bucket = "'all'" if period == "all" else f"strftime('{fmt}', created, 'unixepoch')"
        where, args = ["1=1"], []
        for clause, value in (("created >= ?", since), ("created < ?", until),
                              ("tenant = ?", tenant)):
            if value is not None:
                where.append(clause)
                args.append(value)
        sql = (f"SELECT tenant, {bucket} AS period, COUNT(*), SUM(cache_hit_tokens), "
               f"SUM(cache_miss_tokens), SUM(output_tokens), SUM(cost_cache_hit), "
               f"SUM(cost_cache_miss), SUM(cost_output), SUM(cost_total), "
               f"SUM(tier = 'batch'), TOTAL(CASE WHEN tier = 'batch' THEN cost_total END) "
               f"FROM requests WHERE {' AND '.join(where)} GROUP BY tenant, period "
               f"ORDER BY period DESC, tenant")
        names = TOTALS_NAMES
        with self._connect() as db:
            return [dict(zip(names, r)) for r in db.execute(sql, args).fetchall()]


def create_private(path: str) -> None:
    """Create the database file 0600 (and a new folder for it 0700), whatever the umask, and
    tighten an existing database, -wal or -shm file that group or others could read."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    _tighten(path, create=True)
    for suffix in ("-wal", "-shm"):  # left by an earlier run under the old mode
        try:
            _tighten(path + suffix)
        except FileNotFoundError:
            pass


def _tighten(path: str, create: bool = False) -> None:
    flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)  # the umask can only narrow 0600
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # by descriptor: the file checked is the file changed
    finally:
        os.close(fd)


def _insert_new(db: sqlite3.Connection, insert: str, rows: list[tuple]) -> list[bool]:
    """Insert the rows whose id (their first value) the table does not hold yet, in the
    caller's transaction; for each row, whether it was inserted. Only the writer thread
    writes, so what the SELECT saw still holds when the INSERT runs."""
    ids = list({r[0] for r in rows})
    present: set[str] = set()
    for i in range(0, len(ids), 500):  # under SQLite's oldest limit of 999 variables
        chunk = ids[i:i + 500]
        present.update(r[0] for r in db.execute(
            f"SELECT id FROM requests WHERE id IN ({','.join('?' * len(chunk))})", chunk))
    fresh = []
    for r in rows:
        fresh.append(r[0] not in present)
        present.add(r[0])  # the same id twice in one batch: the first one counts
    db.executemany(insert, [r for r, new in zip(rows, fresh) if new])
    return fresh


def _resolve(settled: list[tuple[asyncio.Future, bool]], error: Exception | None) -> None:
    """Resolve committed rows' futures on their loops (with whether each row was new): one
    callback per loop and batch."""
    by_loop: dict = {}
    for f, new in settled:
        by_loop.setdefault(f.get_loop(), []).append((f, new))
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_futures, group, error)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass


def _settle_futures(settled: list[tuple[asyncio.Future, bool]],
                    error: Exception | None) -> None:
    for f, new in settled:
        if f.done():
            continue
        if error is None:
            f.set_result(new)
        else:
            f.set_exception(error)
            f.exception()  # mark retrieved: an answer that no longer waits must not warn


def now() -> float:
    return time.time()
