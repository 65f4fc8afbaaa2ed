"""What the DCP client and server transports share: the socket options of a connection."""

from __future__ import annotations

import asyncio
import socket


def tune_socket(transport: asyncio.BaseTransport, rcvbuf: int | None = None) -> None:
    """TCP_NODELAY (DCP is request/response during the handshake), and a larger receive
    buffer where asked (the consumer reads in 8 MiB batches)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    except OSError:
        pass
