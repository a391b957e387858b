"""The batch tier's tables and statements, written once for SQLite and PostgreSQL.

Statements use PostgreSQL's `$n` placeholders; the SQLite backend rewrites them to `?n`
(`sqlite_sql`), and the schema's BLOB becomes BYTEA for PostgreSQL. Every write that could be
repeated (a rerun after a crash, two gateways racing) is insert-if-absent or a conditional
update, so a repeat changes nothing:
- a line's result is keyed by (batch_id, custom_id) and inserted ON CONFLICT DO NOTHING;
- a batch moves status only FROM the statuses the move allows (`move`);
- a batch is claimed by one gateway at a time: `owner` and `lease_until`, renewed by its
  owner, taken over by another gateway once the lease has run out (CLAIM).
"""
from __future__ import annotations

import re

OPEN = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_sha256 TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
    in_progress_at BIGINT, finalizing_at BIGINT, completed_at BIGINT, failed_at BIGINT,
    expired_at BIGINT, cancelling_at BIGINT, cancelled_at BIGINT,
    total BIGINT NOT NULL DEFAULT 0, metadata TEXT, errors TEXT,
    output_file_id TEXT, error_file_id TEXT,
    owner TEXT, lease_until DOUBLE PRECISION NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line_no INTEGER NOT NULL,
    body TEXT NOT NULL, attempt INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line_no INTEGER NOT NULL,
    failed INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE TABLE IF NOT EXISTS batch_rejects (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no)
);
"""

FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at"
PUT_FILE = ("INSERT INTO batch_files (id, tenant, purpose, filename, bytes, created_at, content) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING")
GET_FILE = f"SELECT {FILE_COLUMNS} FROM batch_files WHERE id = $1 AND tenant = $2"
FILE_CONTENT = "SELECT content FROM batch_files WHERE id = $1 AND tenant = $2"
DELETE_FILE = "DELETE FROM batch_files WHERE id = $1 AND tenant = $2"
# newest first, after the cursor `$2` (an id whose created_at and id bound the page)
LIST_FILES = (f"SELECT {FILE_COLUMNS} FROM batch_files WHERE tenant = $1 "
              "AND ($2 = '' OR (created_at, id) < (SELECT created_at, id FROM batch_files "
              "WHERE id = $2 AND tenant = $1)) AND ($3 = '' OR purpose = $3) "
              "ORDER BY created_at DESC, id DESC LIMIT $4")

BATCH_COLUMNS = ("id, tenant, key_sha256, endpoint, input_file_id, completion_window, status, "
                 "created_at, expires_at, in_progress_at, finalizing_at, completed_at, "
                 "failed_at, expired_at, cancelling_at, cancelled_at, total, metadata, errors, "
                 "output_file_id, error_file_id")
# the request counts read with the batch: done and failed results, and rejected lines
COUNTS = ("(SELECT COUNT(*) FROM batch_results r WHERE r.batch_id = b.id AND r.failed = 0), "
          "(SELECT COUNT(*) FROM batch_results r WHERE r.batch_id = b.id AND r.failed = 1) + "
          "(SELECT COUNT(*) FROM batch_rejects j WHERE j.batch_id = b.id)")
CREATE_BATCH = ("INSERT INTO batches (id, tenant, key_sha256, endpoint, input_file_id, "
                "completion_window, status, created_at, expires_at, metadata) "
                "VALUES ($1, $2, $3, $4, $5, $6, 'validating', $7, $8, $9)")
GET_BATCH = f"SELECT {BATCH_COLUMNS}, {COUNTS} FROM batches b WHERE id = $1 AND tenant = $2"
LIST_BATCHES = (f"SELECT {BATCH_COLUMNS}, {COUNTS} FROM batches b WHERE tenant = $1 "
                "AND ($2 = '' OR (created_at, id) < (SELECT created_at, id FROM batches "
                "WHERE id = $2 AND tenant = $1)) ORDER BY created_at DESC, id DESC LIMIT $3")
OPEN_LIST = ", ".join(f"'{s}'" for s in OPEN)
COUNT_OPEN = f"SELECT COUNT(*) FROM batches WHERE tenant = $1 AND status IN ({OPEN_LIST})"

# $1 owner, $2 new lease end, $3 now: renew this gateway's open batches and take those whose
# owner's lease ran out, in one statement; every batch this gateway now holds comes back
CLAIM = (f"UPDATE batches SET owner = $1, lease_until = $2 WHERE status IN ({OPEN_LIST}) "
         "AND (owner = $1 OR owner IS NULL OR lease_until < $3) "
         "RETURNING id, tenant, key_sha256, endpoint, input_file_id, status, expires_at, "
         "created_at")
RELEASE = "UPDATE batches SET owner = NULL, lease_until = 0 WHERE owner = $1"

ADD_LINE = ("INSERT INTO batch_lines (batch_id, custom_id, line_no, body) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (batch_id, custom_id) DO NOTHING")
ADD_REJECT = ("INSERT INTO batch_rejects (batch_id, line_no, line) VALUES ($1, $2, $3) "
              "ON CONFLICT (batch_id, line_no) DO NOTHING")
SET_TOTAL = "UPDATE batches SET total = $2 WHERE id = $1"
# lines without a result, in input order, from line `$2` on
PENDING = ("SELECT l.custom_id, l.line_no, l.body, l.attempt FROM batch_lines l "
           "WHERE l.batch_id = $1 AND l.line_no >= $2 AND NOT EXISTS (SELECT 1 FROM "
           "batch_results r WHERE r.batch_id = l.batch_id AND r.custom_id = l.custom_id) "
           "ORDER BY l.line_no LIMIT $3")
UNFINISHED = ("SELECT l.custom_id, l.line_no FROM batch_lines l WHERE l.batch_id = $1 AND NOT "
              "EXISTS (SELECT 1 FROM batch_results r WHERE r.batch_id = l.batch_id AND "
              "r.custom_id = l.custom_id)")
BUMP_ATTEMPT = ("UPDATE batch_lines SET attempt = attempt + 1 WHERE batch_id = $1 AND "
                "custom_id = $2 RETURNING attempt")
RECORD = ("INSERT INTO batch_results (batch_id, custom_id, line_no, failed, line) "
          "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (batch_id, custom_id) DO NOTHING "
          "RETURNING custom_id")
RESULTS = "SELECT line_no, failed, line FROM batch_results WHERE batch_id = $1"
REJECTS = "SELECT line_no, line FROM batch_rejects WHERE batch_id = $1"
WAITING = (f"SELECT COUNT(*) FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
           f"WHERE b.status IN ({OPEN_LIST}) AND NOT EXISTS (SELECT 1 FROM batch_results r "
           "WHERE r.batch_id = l.batch_id AND r.custom_id = l.custom_id)")


def move(status: str, from_statuses: tuple[str, ...], stamp: str | None,
         extra: tuple[str, ...] = ()) -> str:
    """UPDATE a batch ($1) to `status` from one of `from_statuses`, stamping `stamp` with $2
    and setting `extra` columns from $3 on; the id comes back only if it moved."""
    sets = [f"status = '{status}'"] + ([f"{stamp} = $2"] if stamp else [])
    sets += [f"{column} = ${i}" for i, column in enumerate(extra, start=3)]
    froms = ", ".join(f"'{s}'" for s in from_statuses)
    return (f"UPDATE batches SET {', '.join(sets)} WHERE id = $1 AND status IN ({froms}) "
            "RETURNING id")


def sqlite_sql(sql: str) -> str:
    """PostgreSQL's `$n` placeholders as SQLite's `?n`."""
    return re.sub(r"\$(\d+)", r"?\1", sql)


def postgres_schema() -> str:
    return SCHEMA.replace(" BLOB ", " BYTEA ")
