"""A batch's input file read into lines to run and lines rejected, each rejected line with
the reason the error file gives for it.

A line is `{"custom_id", "method": "POST", "url", "body"}`; its url must be the batch's
endpoint, its custom_id unique in the file, and its body valid for the endpoint by the very
validators the online routes run (gateway/openai/): what the online route would refuse with a
400, the batch refuses for that line alone, and the other lines run.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import APIError, bad_request
from gateway.openai.requests import GenerationRequest, parse_chat_request, parse_request
from gateway.openai.responses_api import parse_responses_request

# the endpoints a batch may target, and the request kind each one's lines are
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
             "/v1/responses": "responses"}
MAX_CUSTOM_ID = 512  # characters


@dataclass(frozen=True)
class Line:
    custom_id: str
    line_no: int  # 1-based, in the input file
    body: dict


class LineRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def line_request_id(batch_id: str, custom_id: str) -> str:
    """The id shared by every result line and error line of (batch, custom_id)."""
    digest = hashlib.blake2b(f"{batch_id}\0{custom_id}".encode(), digest_size=12).hexdigest()
    return "batch_req_" + digest


def error_line(batch_id: str, custom_id: str | None, code: str, message: str) -> dict:
    """An error file line for a request that got no response (OpenAI's shape)."""
    rid = line_request_id(batch_id, custom_id if custom_id is not None else message)
    return {"id": rid, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_body(kind: str, body: Any, defaults: dict) -> GenerationRequest:
    """The body's request for the endpoint, or APIError as the online route raises it."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", param="body")
    if body.get("stream"):
        raise bad_request("stream is not supported in a batch: each line's answer is whole",
                          param="stream")
    if kind != "responses":
        return parse_request(kind, body, defaults)
    req = parse_responses_request(body)
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported in a batch",
                          param="previous_response_id", code="unsupported_parameter")
    try:
        return parse_chat_request(req.chat_body(()), defaults)
    except APIError as exc:
        raise req.renamed(exc, 0) from None


def split_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every non-blank line, without copying the file."""
    view, start, n = memoryview(content), 0, 0
    while start < len(content):
        end = content.find(b"\n", start)
        end = len(content) if end < 0 else end
        n += 1
        line = bytes(view[start:end])  # one line: bounded at upload by the body limit
        if line.strip():
            yield n, line
        start = end + 1


def read_lines(content: bytes, endpoint: str, check: Callable[[str, Any], Any]
               ) -> tuple[list[Line], list[tuple[int, str, str | None, str]]]:
    """The lines to run, and the refused ones as (line_no, code, custom_id, message).
    `check(kind, body)` validates a body (raising APIError), the online routes' way."""
    kind = ENDPOINTS[endpoint]
    lines: list[Line] = []
    refused: list[tuple[int, str, str | None, str]] = []
    seen: set[str] = set()
    for n, raw in split_lines(content):
        custom_id = None
        try:
            obj = _json(raw)
            custom_id = _custom_id(obj)
            _check_target(obj, endpoint)
            if custom_id in seen:
                raise LineRefused("duplicate_custom_id",
                                  f"custom_id {custom_id[:100]!r} is used by an earlier line")
            try:
                check(kind, obj["body"])
            except APIError as exc:
                param = f" (param {exc.param})" if exc.param else ""
                raise LineRefused("invalid_request", f"{exc.message}{param}") from None
            seen.add(custom_id)
            lines.append(Line(custom_id, n, obj["body"]))
        except LineRefused as exc:
            refused.append((n, exc.code, custom_id, f"line {n}: {exc}"))
    return lines, refused


def _json(raw: bytes) -> dict:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LineRefused("invalid_json_line", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineRefused("invalid_json_line", "a line must be a JSON object")
    return obj


def _custom_id(obj: dict) -> str:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineRefused("missing_required_parameter", "custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise LineRefused("invalid_request", f"custom_id is longer than {MAX_CUSTOM_ID} "
                          "characters")
    return custom_id


def _check_target(obj: dict, endpoint: str) -> None:
    if obj.get("method", "POST") != "POST":
        raise LineRefused("invalid_request", "method must be POST")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineRefused("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, not "
                          f"{str(url)[:100]!r}")
    if url != endpoint:
        raise LineRefused("mismatched_url", f"url {url} is not the batch's endpoint {endpoint}")
    if "body" not in obj:
        raise LineRefused("missing_required_parameter", "body is missing")
