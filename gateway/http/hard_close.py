"""Closing a connection whose peer stopped reading, without waiting on that peer.

A plain close keeps the unsent bytes, in the transport and in the kernel, until the peer reads
them, which a stalled client never does. `hard_close` discards both: with SO_LINGER set to
zero the kernel answers with a reset instead of holding the send buffer in FIN-WAIT.

It never raises. It runs on connections already half gone, where the event loop has its own
ideas of what a closed socket raises (uvloop: `ValueError("negative file descriptor")`, not
`OSError`); callers drop a connection to end its requests, and an exception here must not
skip that. Callers still cancel their requests before calling it.
"""
from __future__ import annotations

import logging
import socket
import struct

log = logging.getLogger(__name__)
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def hard_close(transport) -> None:
    if transport is None:
        return
    try:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    except Exception as exc:  # noqa: BLE001 - closed already; the abort still drops the buffers
        log.debug("no reset on close (%r); aborting anyway", exc)
    try:
        transport.abort()
    except Exception as exc:  # noqa: BLE001 - a transport already gone has nothing to drop
        log.debug("aborting a closed transport failed: %r", exc)
