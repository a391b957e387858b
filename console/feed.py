"""The gateway's telemetry feed as an async stream of events; recording and replay. No UI.

A source is anything with `async def events()` yielding `Status` (connection changes) and
`Frame` (one decoded JSON object, not yet validated: the state model does that) events.
`LiveFeed` reads `GET /admin/telemetry` over a WebSocket and reconnects forever;
`ReplayFeed` plays a recording made with `Recorder` (JSONL: {"t": seconds, "frame": {...}}).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

FEED_PATH = "/admin/telemetry"


@dataclass(frozen=True)
class Frame:
    data: dict[str, Any]


@dataclass(frozen=True)
class Status:
    state: str  # connecting | connected | disconnected | replaying | ended
    detail: str = ""


@dataclass(frozen=True)
class Malformed:
    text: str


Event = Frame | Status | Malformed


def decode(text: str | bytes) -> dict[str, Any] | None:
    """A frame's JSON object, or None when the text is not a JSON object."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def feed_url(url: str) -> str:
    """The WebSocket URL of the feed from a gateway base URL (http(s) or ws(s), path optional)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith(FEED_PATH):
        path += FEED_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class Recorder:
    """Appends each frame to a JSONL file with its receive time (seconds since the first)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        self.file = open(path, "wb")  # noqa: SIM115 (open for the recorder's lifetime)
        self.clock = clock
        self.t0: float | None = None

    def write(self, frame: dict[str, Any]) -> None:
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        line = orjson.dumps({"t": round(now - self.t0, 3), "frame": frame})
        self.file.write(line + b"\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class LiveFeed:
    """The live feed of one gateway; reconnects with backoff after any failure."""

    def __init__(self, url: str, api_key: str | None = None, recorder: Recorder | None = None,
                 min_backoff: float = 0.5, max_backoff: float = 5.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.url = feed_url(url)
        self.api_key = api_key
        self.recorder = recorder
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.sleep = sleep

    async def events(self) -> AsyncIterator[Event]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        backoff = self.min_backoff
        async with aiohttp.ClientSession(headers=headers) as session:
            while True:
                yield Status("connecting", self.url)
                try:
                    async with session.ws_connect(self.url, heartbeat=10.0,
                                                  max_msg_size=16 * 2**20) as ws:
                        backoff = self.min_backoff
                        yield Status("connected", self.url)
                        async for msg in ws:
                            if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                                yield self._frame(msg.data)
                            elif msg.type == aiohttp.WSMsgType.ERROR:
                                break
                    reason = "closed by gateway"
                except aiohttp.WSServerHandshakeError as e:
                    reason = f"HTTP {e.status}" + (" (admin key?)" if e.status in (401, 403)
                                                   else "")
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    reason = type(e).__name__
                yield Status("disconnected", f"{reason}; retry in {backoff:g}s")
                await self.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)

    def _frame(self, text: str | bytes) -> Event:
        frame = decode(text)
        if frame is None:
            return Malformed(text[:200] if isinstance(text, str) else repr(text[:200]))
        if self.recorder is not None:
            self.recorder.write(frame)
        return Frame(frame)


def read_recording(path: str | Path) -> list[tuple[float, dict[str, Any] | None]]:
    """(t, frame) per line; frame is None for a line that is not a recorded frame."""
    out: list[tuple[float, dict[str, Any] | None]] = []
    last_t = 0.0
    for line in Path(path).read_bytes().splitlines():
        if not line.strip():
            continue
        rec = decode(line)
        t = rec.get("t") if rec else None
        frame = rec.get("frame") if rec else None
        if isinstance(t, (int, float)) and isinstance(frame, dict):
            last_t = float(t)
            out.append((last_t, frame))
        else:
            out.append((last_t, None))
    return out


class ReplayFeed:
    """Plays a recording at `speed` times real time (0: as fast as possible)."""

    def __init__(self, path: str | Path, speed: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.speed = speed
        self.sleep, self.clock = sleep, clock

    async def events(self) -> AsyncIterator[Event]:
        records = read_recording(self.path)
        label = "as fast as possible" if self.speed <= 0 else f"x{self.speed:g}"
        yield Status("replaying", f"{self.path.name} {label}")
        start = self.clock()
        for t, frame in records:
            if self.speed > 0:
                delay = start + t / self.speed - self.clock()
                if delay > 0:
                    await self.sleep(delay)
            yield Frame(frame) if frame is not None else Malformed(f"bad line in {self.path}")
            if self.speed <= 0:
                await self.sleep(0)  # let the UI breathe between frames
        yield Status("ended", f"{self.path.name}: {len(records)} frames")
