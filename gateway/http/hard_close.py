"""Closing a connection whose peer stopped reading, without waiting on that peer.

A plain close keeps the unsent bytes, in the transport and in the kernel, until the peer reads
them, which a stalled client never does. `hard_close` discards both: with SO_LINGER set to
zero the kernel answers with a reset instead of holding the send buffer in FIN-WAIT.
"""
from __future__ import annotations

import socket
import struct

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def hard_close(transport) -> None:
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        except OSError:
            pass  # already gone
    transport.abort()
