"""OpenAI's Files API for batch input: POST /v1/files (multipart, purpose "batch"),
GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.

An upload is read as it arrives, chunk by chunk, into one buffer that the store then takes
as it is (never a second copy of the file): the file's size, its number of lines and each
line's length are checked on the way, so a file over a limit is refused as soon as it passes
it. The rest of a refused upload is read and dropped (up to the file limit), so the client,
which sends its whole body before it reads the answer, gets the 4xx rather than a reset.
A tenant sees only its own files: another tenant's id is answered as unknown (404).
"""
from __future__ import annotations

import time

from aiohttp import BodyPartReader, web

from billing.keys import ApiKey
from gateway.batch.runner import BATCH, BatchRunner
from gateway.batch.store import new_id
from gateway.errors import APIError, bad_request, not_found
from gateway.http.auth import authenticate
from gateway.http.error_middleware import json_response
from gateway.state import STATE

PURPOSES = ("batch",)  # what an upload may be for; batch_output files are the tier's own
MULTIPART_SLACK = 64 << 10  # the multipart envelope around the file, at most


def file_object(row: tuple) -> dict:
    file_id, _, purpose, filename, size, created_at = row[:6]
    return {"id": file_id, "object": "file", "bytes": int(size), "created_at": int(created_at),
            "filename": filename, "purpose": purpose, "status": "processed",
            "status_details": None, "expires_at": None}


def caller(request: web.Request) -> tuple[BatchRunner, ApiKey]:
    """The batch runner (its store and limits) and the caller's key (401 without one)."""
    key = authenticate(request, request.app[STATE].keys)
    return request.app[BATCH], key


def file_missing(file_id: str, param: str | None = None) -> APIError:
    return not_found(f"No such File object: {file_id[:100]}", param=param)


class Upload:
    """The checks made on an upload as it arrives."""

    def __init__(self, max_bytes: int, max_line: int, max_lines: int):
        self.max_bytes, self.max_line, self.max_lines = max_bytes, max_line, max_lines
        self.data = bytearray()
        self.line_bytes = 0  # bytes since the last newline
        self.lines = 0
        self.seen = 0  # bytes read, kept or not
        self.refusal: APIError | None = None

    def feed(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        if self.refusal is not None:
            return
        if len(self.data) + len(chunk) > self.max_bytes:
            self.refusal = APIError(413, f"the file is over {self.max_bytes} bytes, the most "
                                    "this server takes (--batch-max-file-bytes)",
                                    param="file", code="file_too_large")
            self.data = bytearray()
            return
        self._count_lines(chunk)
        if self.refusal is None:
            self.data += chunk
        else:
            self.data = bytearray()

    def _count_lines(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._line_ends(end - start)
            start = end + 1
        self.line_bytes += len(chunk) - start
        if self.line_bytes > self.max_line:
            self._too_long()

    def _line_ends(self, tail: int) -> None:
        self.line_bytes += tail
        if self.line_bytes > self.max_line:
            self._too_long()
        self.lines += 1
        self.line_bytes = 0
        if self.lines > self.max_lines:
            self.refusal = bad_request(f"the file has more than {self.max_lines} lines, the "
                                       "most a batch takes (--batch-max-lines)", param="file",
                                       code="too_many_lines")

    def _too_long(self) -> None:
        self.refusal = self.refusal or bad_request(
            f"line {self.lines + 1} of the file is over {self.max_line} bytes, the largest "
            "request body this server takes", param="file", code="line_too_long")


async def upload_file(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    limits = runner.settings
    if (request.content_length or 0) > limits.max_file_bytes + MULTIPART_SLACK:
        raise APIError(413, f"the upload is over {limits.max_file_bytes} bytes, the most this "
                       "server takes (--batch-max-file-bytes)", param="file",
                       code="file_too_large")
    if not request.content_type.startswith("multipart/"):
        raise APIError(415, "upload a file as multipart/form-data with fields `file` and "
                       "`purpose`", code="unsupported_media_type")
    state = request.app[STATE]
    upload = Upload(limits.max_file_bytes, state.config.max_body_bytes, limits.max_lines)
    purpose, filename = None, None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise bad_request("nested multipart bodies are not supported")
        if part.name == "purpose":
            purpose = (await part.read(decode=True))[:64].decode(errors="replace")
        elif part.name == "file":
            filename = (part.filename or "upload.jsonl")[:256]
            while chunk := await part.read_chunk(1 << 16):
                upload.feed(chunk)
                if upload.seen > limits.max_file_bytes and upload.refusal is not None:
                    raise upload.refusal  # past the limit: not worth reading to its end
        else:
            await part.release()
    if upload.refusal is not None:
        raise upload.refusal
    if filename is None:
        raise bad_request("the `file` field is missing", param="file")
    if purpose not in PURPOSES:
        raise bad_request(f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r:.80}",
                          param="purpose")
    if upload.line_bytes:  # a last line without its newline
        upload._line_ends(0)
        if upload.refusal is not None:
            raise upload.refusal
    file_id = new_id("file-")
    now = int(time.time())
    await runner.store.put_file(file_id, tenant, purpose, filename, upload.data, now)
    return json_response(file_object((file_id, tenant, purpose, filename, len(upload.data),
                                      now)))


async def get_file(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    file_id = request.match_info["file_id"]
    row = await runner.store.get_file(tenant, file_id)
    if row is None:
        raise file_missing(file_id)
    return json_response(file_object(row))


async def file_content(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    file_id = request.match_info["file_id"]
    content = await runner.store.file_content(tenant, file_id)
    if content is None:
        raise file_missing(file_id)
    return web.Response(body=content, content_type="application/octet-stream")


async def delete_file(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    file_id = request.match_info["file_id"]
    if not await runner.store.delete_file(tenant, file_id):
        raise file_missing(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


def page_limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"limit must be an integer, not {raw[:40]!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be between 1 and {most}", param="limit")
    return limit


async def list_files(request: web.Request):
    runner, key = caller(request)
    tenant = key.tenant.name
    limit = page_limit(request, 100, 10_000)
    after = request.query.get("after", "")[:200]
    purpose = request.query.get("purpose", "")[:64]
    rows = await runner.store.list_files(tenant, after, purpose, limit + 1)
    data = [file_object(r) for r in rows[:limit]]
    return json_response({"object": "list", "data": data, "has_more": len(rows) > limit,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


def add_files_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
