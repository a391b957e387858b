"""The worker protocol: typed frames, length-prefixed orjson on a byte stream (no pickle).

A frame is a 4-byte big-endian length, then that many bytes of one JSON object whose "type"
names its class below. `encode_frame` and `decode_frame` are the only encoder and decoder; a
body that is not a known frame with exactly its fields is a `ProtocolError`.

gateway -> worker: AddRequest, AbortRequest, Shutdown; with disaggregation ExportKV, ImportKV.
worker -> gateway: Ready, Step (one per engine step), Rejected, IdleStats (about once a second
while idle), KvEvents (prefix-cache blocks stored and removed, for prefix-aware routing); with
disaggregation TransferDone, ImportFailed.

Over TCP (runtime/transport/serve.py) a challenge-response handshake comes before any frame: the
worker sends `hello` (whether it wants the shared secret, and a fresh nonce); where it does, the
gateway answers with its own nonce and an HMAC of both under the secret, and the worker proves
it knows the secret too, so neither side talks frames to a stranger.

A frame that starts a request (AddRequest, ImportKV) carries its `SamplingParams` itself:
orjson writes them as a nested object of their fields (natively, like the frame), and the
decoder rebuilds and validates them, so a bad payload is a malformed frame like any other. A
worker's Ready frame reports its KV capacity in tokens, which the gateway's admission checks a
request's prompt and output budget against before queueing it.

A Step carries its outputs as `Output` dicts (a TypedDict: typed for the checker, plain for the
decoder). A step of 1,024 requests decodes in about 1.5 ms as dicts; building a dataclass per
output tripled that, on the path every token takes.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import struct
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict, cast

import orjson

from contract.sampling_params import SamplingParams

MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame that is too large, not JSON, or not a known frame with its fields."""


class Output(TypedDict, total=False):
    """One request's progress in one step."""

    id: str
    tokens: list[int]  # new token ids
    text: str  # new text
    finished: bool
    reason: str | None  # finish reason: stop, length, abort, error, rejected
    stop_reason: int | str | None
    usage: list[int] | None  # [prompt, cached, completion]; None for an ended-unbilled one
    logprobs: list | None  # [[token, logprob, [[id, logprob], ...]], ...]
    # only on the first output with tokens of a request asking for them: one entry per prompt
    # token, [None, [token, logprob, rank, [[id, logprob], ...]], ...]; logprobs >= -9999.0
    prompt_logprobs: list | None
    timing: dict | None  # wall-clock times on the worker, on the final output
    prefilled: dict | None  # disaggregation: the prompt's KV is ready to move
    synthetic: bool  # made by the gateway for a request that ended with nothing to bill


# ---- gateway -> worker ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    salt: str | None = None
    prefill_only: bool = False  # disaggregation: stop and park after the first token
    type: str = field(default="add", init=False)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    id: str
    type: str = field(default="abort", init=False)


@dataclass(frozen=True, slots=True)
class Shutdown:
    type: str = field(default="shutdown", init=False)


@dataclass(frozen=True, slots=True)
class ExportKV:
    """Send a parked request's prompt KV to the decode worker of the pair `key`."""

    id: str
    key: str
    tag: int
    type: str = field(default="export", init=False)


@dataclass(frozen=True, slots=True)
class ImportKV:
    """Receive a request's prompt KV from the prefill worker of the pair `key`, then decode."""

    id: str
    prompt: list[int]
    output: list[int]  # the first token(s), sampled by the prefill worker
    params: SamplingParams
    key: str
    tag: int
    priority: int = 0
    salt: str | None = None
    cached: int = 0
    timing: dict | None = None
    type: str = field(default="import", init=False)


# ---- worker -> gateway ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's engine is loaded: its facts, and the tokenizer as JSON."""

    pid: int
    model: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    device: str
    eos_token_ids: list[int]
    tokenizer: str
    sampling_defaults: dict = field(default_factory=dict)  # the model's, for omitted fields
    quantization: str = "none"  # how its weights are served (runtime/loading/quantization.py)
    model_id: str = ""  # the prefix-cache hash root (LLMEngine.model_id): routing needs it
    # the most tokens one request (prompt plus max_tokens) can hold in its KV cache; 0: not
    # reported, so the gateway leaves the check to the worker
    kv_capacity_tokens: int = 0
    type: str = field(default="ready", init=False)


@dataclass(frozen=True, slots=True)
class Step:
    outputs: list[Output]
    stats: dict | None  # the engine's snapshot and this step's figures; None on an abort
    type: str = field(default="step", init=False)


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request is refused, nothing billed: at once on AddRequest, or later, before any
    output, when its structured-output grammar fails to compile."""

    id: str
    error: dict  # {"message", "param", "kind"}
    type: str = field(default="rejected", init=False)


@dataclass(frozen=True, slots=True)
class IdleStats:
    stats: dict
    type: str = field(default="stats", init=False)


@dataclass(frozen=True, slots=True)
class KvEvents:
    """Prefix-cache blocks the worker stored and removed since its last KvEvents, as block
    hashes in hex. `cleared`: forget every block of this worker first (a snapshot then lists
    all it holds, sent when a gateway connects). Sent to every gateway: each one routes."""

    stored: tuple[str, ...]
    removed: tuple[str, ...]
    cleared: bool = False
    type: str = field(default="kv_events", init=False)

    def __post_init__(self) -> None:
        # JSON brings lists: tuples keep the frame hashable and equal to the one sent
        for name in ("stored", "removed"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} is one string, not a list of hashes")
            hashes = tuple(value)
            if not all(isinstance(h, str) for h in hashes):
                raise TypeError(f"{name} holds a hash that is not a string")
            object.__setattr__(self, name, hashes)
        if not isinstance(self.cleared, bool):
            raise TypeError("cleared is not a boolean")


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A decode worker received a request's prompt KV."""

    id: str
    blocks: int
    bytes: int
    seconds: float
    start: float
    end: float
    type: str = field(default="transfer", init=False)


@dataclass(frozen=True, slots=True)
class ImportFailed:
    id: str
    error: str
    type: str = field(default="import_failed", init=False)


Frame = (AddRequest | AbortRequest | Shutdown | ExportKV | ImportKV | Ready | Step | Rejected
         | IdleStats | KvEvents | TransferDone | ImportFailed)
_FRAMES: dict[str, type] = {cast(str, cls.__dataclass_fields__["type"].default): cls for cls in (
    AddRequest, AbortRequest, Shutdown, ExportKV, ImportKV, Ready, Step, Rejected, IdleStats,
    KvEvents, TransferDone, ImportFailed)}
_FIELDS = {name: {f.name for f in fields(cls)} - {"type"} for name, cls in _FRAMES.items()}
_WITH_PARAMS = frozenset({"add", "import"})  # frames whose `params` is a SamplingParams


# ---- the one encoder and decoder --------------------------------------------------------
def encode_frame(frame: Frame) -> bytes:
    body = orjson.dumps(frame)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes is over the limit")
    return _HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> Frame:
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    return frame_from_dict(message)


def frame_from_dict(message: Any) -> Frame:
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    kind = message.pop("type", None)
    cls = _FRAMES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown frame type {kind!r:.40}")
    unknown = message.keys() - _FIELDS[kind]
    if unknown:
        raise ProtocolError(f"{kind} frame with unknown fields {sorted(unknown)[:5]}")
    if kind in _WITH_PARAMS and "params" in message:
        message["params"] = _sampling_params(kind, message["params"])
    try:
        return cls(**message)
    except TypeError as exc:  # a required field is missing
        raise ProtocolError(f"{kind} frame: {exc}") from None


def _sampling_params(kind: str, values: Any) -> SamplingParams:
    """A frame's params rebuilt and validated (its lists become the tuples they were)."""
    if not isinstance(values, dict):
        raise ProtocolError(f"{kind} frame: params is not an object")
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:  # unknown or missing fields, bad values
        raise ProtocolError(f"{kind} frame: params: {exc}") from None


def read_frame_blocking(stream) -> Frame | None:
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
    return decode_frame(body)


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    """Read one frame from an asyncio stream; None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {size} bytes is over the limit")
        return decode_frame(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None


# ---- the handshake on a socket, before any frame ------------------------------------------
TOKEN_ENV = "INFERSTACK_WORKER_TOKEN"  # the secret a network worker and its gateways share
_HELLO_MAGIC = b"inferstack-worker/1\n"
NONCE_BYTES = MAC_BYTES = 32
HELLO_BYTES = len(_HELLO_MAGIC) + 1 + NONCE_BYTES


def hello(wants_token: bool, nonce: bytes) -> bytes:
    """The worker's first bytes on a connection: the magic, 1 if it wants the secret, a nonce."""
    return _HELLO_MAGIC + (b"\x01" if wants_token else b"\x00") + nonce


def parse_hello(data: bytes) -> tuple[bool, bytes]:
    """(wants the secret, the worker's nonce) from `hello`'s bytes."""
    if len(data) != HELLO_BYTES or not data.startswith(_HELLO_MAGIC) \
            or data[len(_HELLO_MAGIC)] not in (0, 1):
        raise ProtocolError("the peer is not an inferstack worker")
    return data[len(_HELLO_MAGIC)] == 1, data[len(_HELLO_MAGIC) + 1:]


def proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 of the two nonces under the secret. The role ("gateway", "worker") keeps
    one side's proof from being replayed as the other's."""
    return hmac.new(token.encode(), role + b"|" + first + second, hashlib.sha256).digest()


def check_proof(token: str, role: bytes, first: bytes, second: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(token, role, first, second), mac)


def is_loopback(host: str) -> bool:
    """Every address `host` names is a loopback one ("" and 0.0.0.0 mean every interface): who
    may reach a listener bound there without a secret (the gateway's and a shared worker's)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)
