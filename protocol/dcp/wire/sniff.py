"""What answered a DCP client when the first bytes of a connection are not a memcached binary
frame (sans-IO): an HTTP server (Couchbase's REST port, 8091), a Synapse replication server, a
TLS server, a Redis server. `first_bytes_error` turns the bad-magic error of a connection's
first bytes into one line that names what answered and where DCP lives."""

from __future__ import annotations

from dcptool.protocol.errors import ErrorCode, RemoteError

HTTP = "an HTTP server"
SYNAPSE = "a Synapse replication server"
TLS = "a TLS server"
REDIS = "a Redis server"

_SYNAPSE_COMMANDS = (b"SERVER ", b"PING ", b"POSITION ", b"RDATA ", b"ERROR ", b"USER_SYNC ",
                     b"REMOTE_SERVER_UP ", b"CLEAR_USER_SYNC ")
_DCP_PORTS = "DCP is on the data port, 11210 (11207 with TLS)"
_WHAT_TO_DO = {
    HTTP: f"not a Couchbase data port (8091 is Couchbase's REST port): {_DCP_PORTS}",
    SYNAPSE: "use synapse://HOST:PORT for it",
    TLS: "use couchbases://HOST (TLS; the data port is 11207)",
    REDIS: f"use synapse+redis://HOST:PORT for Synapse over Redis; {_DCP_PORTS}",
}


def classify(first: bytes) -> str | None:
    """Which kind of server sent `first` (the first bytes it wrote on a connection a DCP
    client opened and sent HELLO on), or None when it is none of the known kinds."""
    head = bytes(first[:64])
    if head.startswith(b"HTTP/") or head.lstrip()[:1] == b"<":
        return HTTP
    if head.startswith(_SYNAPSE_COMMANDS):
        return SYNAPSE
    if len(head) >= 2 and head[0] in (0x15, 0x16) and head[1] == 0x03:   # TLS alert / handshake record
        return TLS
    if head[:1] in (b"-", b"+", b"$", b"*", b":") and b"\r\n" in head:  # RESP: -ERR, +OK, ...
        return REDIS
    return None


def _bad_magic(err: BaseException) -> bool:
    return isinstance(err, RemoteError) and err.code == ErrorCode.BAD_MAGIC


def first_bytes_error(err: BaseException, first: bytes, at_start: bool) -> BaseException:
    """`err` (a bad magic at a connection's first byte when `at_start`) as one line saying what
    answered and what to do; any other error, or bytes of no known kind, unchanged."""
    if not at_start or not _bad_magic(err):
        return err
    kind = classify(first)
    if kind is None:
        return err
    return RemoteError(ErrorCode.BAD_MAGIC, f"not a DCP server: {kind} answered ({err}): {_WHAT_TO_DO[kind]}")
