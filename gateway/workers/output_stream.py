"""One request's worker outputs on their way to its client, in bounded memory.

The worker's reader puts outputs here as they arrive and must never wait (it serves every
request of the worker), so the bound cannot be back-pressure: a request whose client has left
this much unread output behind is marked overflowed, and its worker handle aborts it. What was
produced is still delivered and billed; the final output (small) is always accepted.
"""
from __future__ import annotations

import asyncio
from collections import deque

DEFAULT_LIMIT_BYTES = 4 << 20


def output_cost(item) -> int:
    """About the bytes an output holds as Python objects (a logprob alternative is a small
    list of an int and a float, about 124 bytes): the measure of the bound."""
    if not isinstance(item, dict):
        return 256
    cost = 200 + len(item.get("text") or "") + 36 * len(item.get("tokens") or ())
    for entry in item.get("logprobs") or ():
        cost += 100 + 124 * len(entry[2])
    # prompt_logprobs are not counted: they come once, on the first output, sized by the
    # request itself (at most the context times 21 entries); counting them would cut off a
    # long prompt's answer as if its reader were slow before it had a chance to read
    return cost


class OutputStream:
    """A FIFO of outputs (dicts, or an exception such as WorkerDied) with a byte bound."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        self.limit_bytes = limit_bytes
        self.buffered_bytes = 0
        self.overflowed = False
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> bool:
        """Append an output; True when this one took the stream over its bound (the caller
        then aborts the request: it happens once per stream)."""
        cost = output_cost(item)
        self._items.append((item, cost))
        self.buffered_bytes += cost
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if not self.overflowed and self.buffered_bytes > self.limit_bytes:
            self.overflowed = True
            return True
        return False

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, cost = self._items.popleft()
        self.buffered_bytes -= cost
        return item

    def qsize(self) -> int:
        return len(self._items)
