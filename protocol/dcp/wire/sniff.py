"""What answered a client when the bytes a connection brought (or did not bring) are not the
protocol its source URL names (sans-IO): an HTTP server (Couchbase's REST port, 8091), a
Synapse replication server, a TLS server, a Redis server, a memcached binary (DCP) server.
`classify` names the kind from a connection's first bytes; `wrong_server` is the one line
that says what answered and what to do, for each scheme (`couchbase`, `couchbases`,
`synapse`, `redis`); `first_bytes_error` turns the bad-magic error of a DCP connection's first
bytes into that line. Probing a port that sent nothing is protocol/transport/probe.py's job."""

from __future__ import annotations

from dcptool.protocol.errors import ErrorCode, RemoteError

HTTP = "an HTTP server"
SYNAPSE = "a Synapse replication server"
TLS = "a TLS server"
REDIS = "a Redis server"
DCP = "a Couchbase data port (memcached binary protocol)"

_SYNAPSE_COMMANDS = (b"SERVER ", b"PING ", b"POSITION ", b"RDATA ", b"ERROR ", b"USER_SYNC ",
                     b"REMOTE_SERVER_UP ", b"CLEAR_USER_SYNC ")
_DCP_PORTS = "DCP is on the data port, 11210 (11207 with TLS)"
_SYNAPSE_PORT = "synapse:// wants the main process's TCP replication listener (often 9092)"
_REDIS_PORT = "synapse+redis:// wants the Redis server Synapse publishes on (6379 by default)"

# scheme -> (what that scheme wants, {kind: what to do})
_ADVICE: dict[str, tuple[str, dict[str, str]]] = {
    "couchbase": ("a DCP server", {
        HTTP: f"not a Couchbase data port (8091 is Couchbase's REST port): {_DCP_PORTS}",
        SYNAPSE: "use synapse://HOST:PORT for it",
        TLS: "use couchbases://HOST (TLS; the data port is 11207)",
        REDIS: f"use synapse+redis://HOST:PORT?server_name=NAME for Synapse over Redis; {_DCP_PORTS}",
    }),
    "couchbases": ("a DCP server with TLS", {
        HTTP: f"not a Couchbase data port (8091 is Couchbase's REST port): {_DCP_PORTS}",
        SYNAPSE: "use synapse://HOST:PORT for it",
        REDIS: "use synapse+redis://HOST:PORT?server_name=NAME for Synapse over Redis",
        DCP: "it speaks DCP without TLS: use couchbase://HOST (the data port is 11210)",
    }),
    "synapse": ("a Synapse replication server", {
        HTTP: f"{_SYNAPSE_PORT}, not an HTTP listener",
        TLS: f"{_SYNAPSE_PORT} (plain TCP); for Redis with TLS use synapse+rediss://HOST:PORT?server_name=NAME",
        REDIS: "use synapse+redis://HOST:PORT?server_name=NAME for it",
        DCP: "use couchbase://HOST:PORT/BUCKET for it",
    }),
    "redis": ("a Redis server", {
        HTTP: f"{_REDIS_PORT}, not an HTTP listener",
        SYNAPSE: "use synapse://HOST:PORT for it",
        TLS: "use synapse+rediss://HOST:PORT?server_name=NAME (Redis with TLS)",
        DCP: "use couchbase://HOST:PORT/BUCKET for it",
    }),
}


def classify(first: bytes) -> str | None:
    """Which kind of server sent `first` (the first bytes it wrote on a connection a client
    opened and wrote on), or None when it is none of the known kinds."""
    head = bytes(first[:64])
    if head.startswith(b"HTTP/") or head.lstrip()[:1] == b"<":
        return HTTP
    if head.startswith(_SYNAPSE_COMMANDS):
        return SYNAPSE
    if len(head) >= 2 and head[0] in (0x15, 0x16) and head[1] == 0x03:   # TLS alert / handshake record
        return TLS
    if head[:1] in (b"-", b"+", b"$", b"*", b":") and b"\r\n" in bytes(first[:1024]):  # RESP: -ERR, +OK
        return REDIS
    if len(head) >= 24 and head[0] in (0x81, 0x19):      # a memcached binary response (classic / alt)
        return DCP
    return None


def wrong_server(kind: str, scheme: str, where: str, detail: str = "") -> RemoteError | None:
    """The error for `kind` answering at `where` a client of `scheme`: what answered and what to
    do (exit 5); None when `kind` is what the scheme wants, or has no advice."""
    wants, advice = _ADVICE.get(scheme, ("", {}))
    todo = advice.get(kind)
    if todo is None:
        return None
    said = f" ({detail})" if detail else ""
    return RemoteError(ErrorCode.BAD_MAGIC, f"{where} is not {wants}: {kind} answered{said}: {todo}")


def wrong_first_bytes(first: bytes, scheme: str, where: str) -> RemoteError | None:
    """`wrong_server` for the first bytes a connection brought, None when they may be right."""
    kind = classify(first)
    return None if kind is None else wrong_server(kind, scheme, where)


def _bad_magic(err: BaseException) -> bool:
    return isinstance(err, RemoteError) and err.code == ErrorCode.BAD_MAGIC


def first_bytes_error(err: BaseException, first: bytes, at_start: bool, where: str = "the server") -> BaseException:
    """`err` (a bad magic at a DCP connection's first byte when `at_start`) as one line saying
    what answered and what to do; any other error, or bytes of no known kind, unchanged."""
    if not at_start or not _bad_magic(err):
        return err
    kind = classify(first)
    wrong = None if kind is None else wrong_server(kind, "couchbase", where, str(err))
    return err if wrong is None else wrong
