"""What listens on HOST:PORT, asked when a client's first connection there ended (closed, reset,
silent until the timeout) without a byte of its protocol: a TLS server resets a plain
connection, redis-server waits for a newline that a binary HELLO never sends, a memcached
server closes a connection whose first byte is no magic. Each probe is one short connection
of its own, bounded by `timeout`; what the answers mean is protocol/dcp/wire/sniff.py's."""

from __future__ import annotations

import asyncio
import ssl

from dcptool.protocol.dcp.wire import sniff
from dcptool.protocol.errors import RemoteError

PROBE_TIMEOUT = 2.0
# a memcached binary NOOP request: any server of that protocol answers it, before any login
_NOOP = bytes([0x80, 0x0A]) + bytes(22)
_QUIET = (OSError, EOFError, asyncio.TimeoutError, TimeoutError, asyncio.IncompleteReadError)


async def _exchange(host: str, port: int, send: bytes, timeout: float) -> bytes:
    """Up to 64 bytes the server writes after `send` on a fresh connection (b"" for none)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except _QUIET:
        return b""
    try:
        writer.write(send)
        got = b""
        while len(got) < 24:     # a memcached header, a RESP line, an HTTP status line
            part = await asyncio.wait_for(reader.read(64), timeout)
            if not part:
                break
            got += part
            if b"\n" in got:
                break
        return got
    except _QUIET:
        return b""
    finally:
        writer.close()


async def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether a TLS handshake completes there (certificates not checked: only the kind)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx), timeout)
    except (ssl.SSLError, *_QUIET):
        return False
    writer.close()
    return True


async def what_listens(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """The kind of server on HOST:PORT (sniff.HTTP, SYNAPSE, TLS, REDIS, DCP), None if unknown.
    A Redis `PING` line first (HTTP, Synapse and Redis servers answer it, a TLS server may send an
    alert), then a memcached NOOP, then a TLS handshake."""
    kind = sniff.classify(await _exchange(host, port, b"PING\r\n", timeout))
    if kind is not None:
        return kind
    if sniff.classify(await _exchange(host, port, _NOOP, timeout)) == sniff.DCP:
        return sniff.DCP
    return sniff.TLS if await _speaks_tls(host, port, timeout) else None


async def wrong_server(host: str, port: int, scheme: str, timeout: float = PROBE_TIMEOUT) -> RemoteError | None:
    """The one-line error (sniff.wrong_server) when what listens on HOST:PORT is not what
    `scheme` wants; None when it is, or is unknown (the caller's own error stands)."""
    kind = await what_listens(host, port, timeout)
    return None if kind is None else sniff.wrong_server(kind, scheme, f"{host}:{port}")
