"""Sending one request over SSE, WebSocket (our /v1/ws) or plain HTTP, filling its record.

Only the public OpenAI API is used, so any OpenAI-compatible server works for "sse" and "http".
Every time is time.perf_counter() minus the run's origin, taken when the bytes are in hand.
"""
from __future__ import annotations

import time

import aiohttp
import orjson

from loadtest.record import RequestRecord
from loadtest.stream import ChunkReader
from loadtest.workloads import RequestSpec
from loadtest.ws_pool import WSPool

PROTOCOLS = ("sse", "ws", "http")


class Client:
    def __init__(self, url: str, model: str, *, endpoint: str = "chat",
                 protocol: str = "sse", count_mode: str = "usage",
                 extra_body: dict | None = None, timeout: float = 600.0, origin: float = 0.0):
        self.url = url.rstrip("/")
        self.model, self.endpoint, self.protocol = model, endpoint, protocol
        self.count_mode, self.extra_body = count_mode, extra_body or {}
        self.origin = origin
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=30)
        self.session: aiohttp.ClientSession | None = None
        self.ws: WSPool | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                             read_bufsize=1 << 20)
        if self.protocol == "ws":
            self.ws = WSPool(self.session, self.url + "/v1/ws", self.now)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.ws is not None:
            await self.ws.close()
        await self.session.close()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def body(self, spec: RequestSpec, stream: bool) -> dict:
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens}
        if self.endpoint == "chat":
            body["messages"] = spec.messages
        else:
            body["prompt"] = "\n".join(m["content"] for m in spec.messages)
        if stream and self.protocol == "sse":
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.count_mode == "logprobs":
            body["logprobs"] = True if self.endpoint == "chat" else 0
        if spec.priority is not None:
            body["priority"] = spec.priority
        body.update(self.extra_body)
        body.update(spec.extra)
        return body

    def headers(self, spec: RequestSpec) -> dict:
        return {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        """Send `spec`, filling `rec`; never raises for a failed request (rec.error says)."""
        reader = ChunkReader(rec, self.count_mode)
        rec.prompt_chars = spec.prompt_chars
        try:
            if self.protocol == "sse":
                await self._sse(spec, rec, reader)
            elif self.protocol == "ws":
                await self.ws.request(spec.api_key, self.endpoint, self.body(spec, True),
                                      rec, reader)
            else:
                await self._http(spec, rec)
        except TimeoutError:
            reader.fail("timeout", "no complete answer within the timeout")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            reader.fail("truncated", str(exc) or type(exc).__name__)
        except aiohttp.ClientError as exc:
            reader.fail("connection", str(exc) or type(exc).__name__)
        except OSError as exc:
            reader.fail("connection", str(exc))
        if rec.end == 0.0:
            rec.end = self.now()

    def _path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    async def _sse(self, spec: RequestSpec, rec: RequestRecord, reader: ChunkReader) -> None:
        data = orjson.dumps(self.body(spec, True))
        headers = {**self.headers(spec), "Content-Type": "application/json"}
        rec.sent = self.now()
        async with self.session.post(self.url + self._path(), data=data,
                                     headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                return await _http_error(rec, resp, reader, self.now)
            done = await _read_sse(resp, reader, self.now)
            if not done:
                reader.fail("truncated", "the stream ended without data: [DONE]")
            reader.close(self.now())

    async def _http(self, spec: RequestSpec, rec: RequestRecord) -> None:
        data = orjson.dumps(self.body(spec, False))
        headers = {**self.headers(spec), "Content-Type": "application/json"}
        reader = ChunkReader(rec, self.count_mode)
        rec.streamed = False
        rec.sent = self.now()
        async with self.session.post(self.url + self._path(), data=data,
                                     headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                return await _http_error(rec, resp, reader, self.now)
            raw = await resp.read()
        rec.end = self.now()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return reader.fail("bad_frame", raw[:200].decode(errors="replace"))
        if not isinstance(obj, dict) or obj.get("error"):
            return reader.fail("stream_error", str(obj)[:200])
        rec.usage = obj.get("usage")
        choices = obj.get("choices") or []
        text = "".join((c.get("message") or {}).get("content") or c.get("text") or ""
                       for c in choices if isinstance(c, dict))
        rec.output_chars = len(text)
        if not choices or not all(isinstance(c, dict) and c.get("finish_reason")
                                  for c in choices):
            return reader.fail("truncated", "no finish_reason in the response")
        n = rec.completion_tokens if rec.usage else (1 if text else 0)
        rec.chunks = [(rec.end, n)] if n else []  # all tokens at once: TTFT = e2e
        # without a usage the one token is a stand-in, reported as an estimate
        rec.count_source = "usage" if rec.usage else "chunks"


async def _read_sse(resp, reader: ChunkReader, now) -> bool:
    """Feed every `data:` message to the reader; True when `data: [DONE]` arrived.

    Reads whatever bytes are available at once (fewer wake-ups than line by line) and stamps
    every message completed by a read with that read's time."""
    buf = b""
    async for data in resp.content.iter_any():
        t = now()
        buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # ": keep-alive" comments, event: and id: lines
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return True
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    reader.fail("bad_frame", payload[:200].decode(errors="replace"))
                    return False
                reader.feed(t, chunk)
                if reader.record.error:
                    return False
    return False


async def _http_error(rec: RequestRecord, resp, reader: ChunkReader, now) -> None:
    raw = await resp.read()
    message = raw[:300].decode(errors="replace")
    try:
        message = orjson.loads(raw)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    reader.fail(f"http_{resp.status}", message)
    rec.end = now()
