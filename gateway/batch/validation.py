"""A batch's validation: its input file read into the lines to run and the lines refused
(gateway/batch/lines.py, off the event loop), written with the move to in_progress in one
transaction; or the batch failed, with OpenAI's `errors` list, when no line can run."""
from __future__ import annotations

import asyncio
import logging
import time

import orjson

from gateway.batch.lines import error_line, parse_body, read_lines
from gateway.batch.store import BatchStore

log = logging.getLogger(__name__)
MAX_ERRORS = 100  # refusals listed in a failed batch's `errors`


async def validate_batch(store: BatchStore, batch_id: str, tenant: str, file_id: str,
                         endpoint: str, defaults: dict, max_lines: int) -> str:
    """The batch's status after validation: "in_progress" or "failed"."""
    content = await store.file_content(tenant, file_id)
    if content is None:
        return await _fail(store, batch_id, [_error("invalid_file", f"the input file {file_id} "
                                                    "no longer exists", "input_file_id")])
    lines, refused = await asyncio.to_thread(
        read_lines, content, endpoint, lambda kind, body: parse_body(kind, body, defaults))
    del content
    if len(lines) + len(refused) > max_lines:
        return await _fail(store, batch_id, [_error(
            "too_many_lines", f"the input file has {len(lines) + len(refused)} lines; a batch "
            f"takes at most {max_lines}", "input_file_id")])
    if not lines:
        errors = [_error(code, msg, None, n) for n, code, _, msg in refused[:MAX_ERRORS]]
        return await _fail(store, batch_id, errors or [_error(
            "empty_file", "the input file has no line to run", "input_file_id")])
    rejects = [(n, orjson.dumps(error_line(batch_id, cid, code, msg)).decode())
               for n, code, cid, msg in refused]
    await store.start_lines(
        batch_id, [(ln.custom_id, ln.line_no, orjson.dumps(ln.body).decode()) for ln in lines],
        rejects, int(time.time()))
    log.info("batch %s: %d lines to run, %d refused", batch_id, len(lines), len(refused))
    return "in_progress"


def _error(code: str, message: str, param: str | None, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


async def _fail(store: BatchStore, batch_id: str, errors: list[dict]) -> str:
    await store.move(batch_id, "failed", ("validating",), "failed_at", int(time.time()),
                     ("errors", orjson.dumps({"object": "list", "data": errors}).decode()))
    return "failed"
