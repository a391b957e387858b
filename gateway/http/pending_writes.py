"""Since when a client has kept a write waiting: the one measure of a reader that stopped.

Writes return at once while the client's socket buffer has room and wait while it is full, so
the age of the oldest write still in progress tells a slow client from a gone one. SSE
streams and WebSocket connections both keep one of these and drop the client when the age
passes the send timeout.
"""
from __future__ import annotations

import time


class PendingWrites:
    """Use as `with pending: await write(...)` around every write to one client."""

    def __init__(self):
        self._count = 0  # writes in progress (a stream's and its keep-alive's may overlap)
        self.since: float | None = None  # monotonic start of the oldest one

    def __enter__(self) -> PendingWrites:
        self._count += 1
        if self.since is None:
            self.since = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self._count -= 1
        if self._count == 0:
            self.since = None

    def stalled(self, timeout: float) -> bool:
        """A write has waited on the client for `timeout` seconds (never, for 0)."""
        return bool(timeout) and self.since is not None and \
            time.monotonic() - self.since >= timeout
