"""A batch's end: its output and error files written from the recorded results, then its
final status, in that order, so that a batch seen as ended always has its files.

Both files' ids are derived from the batch's id and written insert-if-absent, and the final
move is allowed only from the statuses before it: a gateway that dies halfway and the one
that takes the batch over write the same files once and end the batch once.
"""
from __future__ import annotations

import hashlib
import time

from gateway.batch.store import BatchStore

FINAL_MOVES = {  # final status -> (statuses it may come from, its timestamp column)
    "completed": (("finalizing",), "completed_at"),
    "expired": (("in_progress", "finalizing"), "expired_at"),
    "cancelled": (("cancelling",), "cancelled_at"),
}


def result_file_id(batch_id: str, which: str) -> str:
    return "file-" + hashlib.blake2b(f"{batch_id}\0{which}".encode(), digest_size=12).hexdigest()


async def finalize(store: BatchStore, batch_id: str, tenant: str, status: str) -> bool:
    """Write the files and end the batch as `status`; True if this call ended it."""
    results = await store.results(batch_id)
    rejects = await store.rejects(batch_id)
    outputs = sorted((n, line) for n, failed, line in results if not failed)
    errors = sorted([(n, line) for n, failed, line in results if failed] + list(rejects))
    now = int(time.time())
    ids: dict[str, str | None] = {}
    for which, lines in (("output", outputs), ("error", errors)):
        if not lines:
            ids[which] = None
            continue
        ids[which] = result_file_id(batch_id, which)
        content = "".join(line + "\n" for _, line in lines).encode()
        await store.put_file(ids[which], tenant, "batch_output", f"{batch_id}_{which}.jsonl",
                             content, now)
    froms, stamp = FINAL_MOVES[status]
    return await store.move(batch_id, status, froms, stamp, now,
                            ("output_file_id", ids["output"]), ("error_file_id", ids["error"]))
