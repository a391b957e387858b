"""The worker protocol: length-prefixed orjson frames over a byte stream (no pickle anywhere).

A frame is a 4-byte big-endian length, then that many bytes of one JSON object with a "type".

gateway -> worker
  {"type": "add", "id", "prompt": [ids], "params": {SamplingParams fields}, "priority", "salt"}
  {"type": "abort", "id"}
  {"type": "shutdown"}
worker -> gateway
  {"type": "ready", "model", "max_model_len", "vocab_size", "num_blocks", "block_size",
   "max_num_seqs", "pid", "device", "tokenizer": <tokenizer JSON>}
  {"type": "step", "outputs": [output...], "stats": {...}}   one frame per engine step
  {"type": "rejected", "id", "error": {"message", "param", "kind"}}
  {"type": "stats", "stats": {...}}   while idle, about once a second
An output is {"id", "tokens", "text", "finished", "reason", "stop_reason", "usage":
[prompt, cached, completion], "logprobs": [[token, logprob, [[id, logprob], ...]], ...] | null}.
"""
from __future__ import annotations

import asyncio
import struct

import orjson

MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame that is too large or not a JSON object."""


def encode_frame(message: dict) -> bytes:
    body = orjson.dumps(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes is over the limit")
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(message, dict) or "type" not in message:
        raise ProtocolError("frame is not a message object")
    return message


def read_frame_blocking(stream) -> dict | None:
    """Read one frame from a binary file object; None at a clean end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes is over the limit")
    body = stream.read(size)
    if len(body) < size:
        return None
    return decode_body(body)


async def read_frame(reader: asyncio.StreamReader) -> dict | None:
    """Read one frame from an asyncio stream; None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {size} bytes is over the limit")
        return decode_body(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None
