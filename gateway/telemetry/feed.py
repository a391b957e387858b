"""The live telemetry feed behind GET /admin/telemetry (see docs/telemetry_feed.md).

Subscribers each get a bounded queue; publishing never waits: a subscriber whose queue is full
is dropped (it reconnects). Spans are batched into one frame per tick; a snapshot of the
gauges goes out every second.
"""
from __future__ import annotations

import asyncio

import orjson

SUBSCRIBER_QUEUE = 256


class Subscriber:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self.dropped = False


class FeedHub:
    def __init__(self):
        self.subscribers: set[Subscriber] = set()
        self._spans: list[dict] = []
        self.frames_sent = 0
        self.subscribers_dropped = 0

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def publish(self, frame: dict) -> None:
        if not self.subscribers:
            return
        data = orjson.dumps(frame)
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(data)
                self.frames_sent += 1
            except asyncio.QueueFull:  # too slow: drop it rather than wait or grow
                sub.dropped = True
                self.subscribers_dropped += 1
                self.subscribers.discard(sub)  # its sender sees `dropped` and closes

    def add_span(self, span: dict) -> None:
        if self.subscribers:
            self._spans.append(span)

    def flush_spans(self, resource: dict) -> None:
        if not self._spans:
            return
        spans, self._spans = self._spans, []
        self.publish({"type": "spans", "resourceSpans": [{
            "resource": resource,
            "scopeSpans": [{"scope": {"name": "inferstack.gateway"}, "spans": spans}]}]})
