"""What a reassembled TCP byte stream carries, and its frames (sans-IO).

`detect` names a connection's protocol from its server port and its first bytes: TLS (a
ClientHello 0x16 0x03, or ports 11207 / 6380 / 18091), memcached/DCP (11210 or a --port,
or a plausible 24-byte header), Redis RESP (6379, or `*N\\r\\n`), Synapse replication
lines (an upper-case command word). `DcpFramer` and `LineFramer` cut one direction into
frames or lines and hand them to a sink with the time of the packet that completed them;
after bytes the capture lost (or at a mid-stream start) they skip to the next whole frame
(DCP: a plausible header, followed by another or by the end of the data; lines: the next
newline) and hand the bytes around the hole to the sink as flagged fragments."""

from __future__ import annotations

import re
import struct

import numpy as np

from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY

DCP_PORTS = frozenset({11210, 11209, 11211})
TLS_PORTS = frozenset({11207, 6380, 18091, 18092, 443})
REDIS_PORTS = frozenset({6379})
MAGICS = frozenset({0x80, 0x81, 0x08, 0x18})
_MAGIC_RE = re.compile(b"[\x80\x81\x08\x18]")
_SYNAPSE_RE = re.compile(rb"[A-Z][A-Z_]{1,20}( |\r?\n)")
_RESP_RE = re.compile(rb"\*[0-9]{1,3}\r\n\$")
MIDSTREAM = "capture began mid-stream"
RESYNC_LIMIT = 1 << 20     # bytes searched for a header before they are given up as one fragment


def plausible_header(buf, i: int, max_body: int = DEFAULT_MAX_BODY) -> bool:
    """A memcached header could start at buf[i] (and, when the data holds it, so could the
    one right after its frame)."""
    if len(buf) - i < 24 or buf[i] not in MAGICS:
        return False
    magic = buf[i]
    if magic in (0x08, 0x18):
        framing, keylen = buf[i + 2], buf[i + 3]
    else:
        framing, keylen = 0, struct.unpack_from(">H", buf, i + 2)[0]
    extlen, datatype = buf[i + 4], buf[i + 5]
    body = struct.unpack_from(">I", buf, i + 8)[0]
    if datatype > 0x07 or body > max_body or framing + extlen + keylen > body:
        return False
    nxt = i + 24 + body
    return nxt + 24 > len(buf) or buf[nxt] in MAGICS


def detect(server_port: int, chunk: bytes, dcp_ports) -> str:
    """'tls', 'dcp', 'redis', 'synapse' or 'other' for a connection to server_port whose
    first bytes (either direction) are chunk."""
    if chunk[:2] == b"\x16\x03" or server_port in TLS_PORTS:
        return "tls"
    if server_port in dcp_ports:
        return "dcp"
    if server_port in REDIS_PORTS or _RESP_RE.match(chunk):
        return "redis"
    if plausible_header(chunk, 0):
        return "dcp"
    if _SYNAPSE_RE.match(chunk):
        return "synapse"
    return "other"


# a direction's bytes are cut into frames this many at a time (or at the importer's flush,
# every 16 MiB of packets over all connections, which bounds what all framers hold together)
SCAN_BYTES = 16 * 2**20
BEFORE, FRAMES, AFTER = 0, 1, 2   # where a fragment sorts among the frames of its packet


class DcpFramer:
    """One direction of a memcached connection: frames out as whole frames. Bytes are
    held until SCAN_BYTES arrived (or the sink asks: `scan`), then cut in one pass; each
    frame gets the time and number of the packet that completed it (`marks`)."""

    def __init__(self, sink, conn, out: bool, midstream: bool):
        self.sink, self.conn, self.out = sink, conn, out
        self.buf = bytearray()
        self.marks: list[tuple[int, int, int]] = []   # (end offset in buf, ts, packet number)
        self.resync = MIDSTREAM if midstream else None

    def data(self, chunk, ts: int, pkt: int) -> None:
        self.buf += chunk
        self.marks.append((len(self.buf), ts, pkt))
        if self.resync is not None or len(self.buf) >= SCAN_BYTES:
            self.scan()

    def scan(self) -> None:
        while self.buf:
            if self.resync is not None and not self._find_header():
                return
            offsets, lengths, consumed, err = columnar.scan(self.buf)
            if len(offsets):
                marks = np.array(self.marks, dtype=np.int64)
                at = np.searchsorted(marks[:, 0], offsets + lengths, side="left")
                self.sink.frames(self.conn, self.out, self._hand(consumed), offsets, lengths,
                                 marks[at, 1], marks[at, 2])
            if err is None:
                return
            self.resync = f"not a frame header ({err})"

    def _hand(self, n: int) -> bytearray:
        """buf[:n] given away without copying it: buf becomes a new buffer holding only the
        unfinished frame after it, and the old one, cut at n, is never written again."""
        whole, self.buf = self.buf, self.buf[n:]
        del whole[n:]
        self.marks = [(end - n, ts, pkt) for end, ts, pkt in self.marks if end > n]
        return whole

    def _cut(self, n: int) -> None:
        del self.buf[:n]
        self.marks = [(end - n, ts, pkt) for end, ts, pkt in self.marks if end > n]

    def _fragment(self, n: int, why: str, where: int = BEFORE, at: tuple | None = None) -> None:
        """buf[:n] as one flagged row, at the packet that brought its last byte (or `at`)."""
        if at is None:
            at = next(((ts, pkt) for end, ts, pkt in self.marks if end >= n), (0, 0))
        self.sink.fragment(self.conn, self.out, bytes(self.buf[:n]), at[0], why, at[1], where)
        self._cut(n)

    def _find_header(self) -> bool:
        buf = self.buf
        found = None
        for m in _MAGIC_RE.finditer(bytes(buf)):
            i = m.start()
            if len(buf) - i < 24:
                break
            if plausible_header(buf, i):
                found = i
                break
        if found is not None:
            if found:
                self._fragment(found, f"{self.resync}: {found} bytes before the first whole frame skipped")
            self.resync = None
            return True
        if len(buf) > RESYNC_LIMIT:
            keep = len(buf) - 23
            self._fragment(keep, f"{self.resync}: {keep} bytes with no frame header skipped")
        return False

    def gap(self, n: int, ts: int, pkt: int) -> None:
        self.scan()
        if self.buf:
            self._fragment(len(self.buf), f"frame cut short: {n} bytes after it were lost by the capture",
                           at=(ts, pkt))
        self.marks = []
        self.resync = f"{n} bytes lost by the capture"

    def end(self, ts: int, why: str) -> None:
        self.scan()
        if self.buf:
            self._fragment(len(self.buf), f"{why} inside this frame", AFTER)


class LineFramer:
    """One direction of a Synapse replication connection: lines out without newline."""

    def __init__(self, sink, conn, out: bool, midstream: bool):
        self.sink, self.conn, self.out = sink, conn, out
        self.buf = b""
        self.resync = MIDSTREAM if midstream else None

    def data(self, chunk, ts: int, pkt: int = 0) -> None:
        chunk = bytes(chunk)
        buf = self.buf + chunk if self.buf else chunk
        if self.resync is not None:
            nl = buf.find(b"\n")
            if nl < 0:
                self.buf = buf
                return
            if nl:
                self.sink.fragment(self.conn, self.out, buf[:nl], ts, f"{self.resync}: the rest of a line")
            buf, self.resync = buf[nl + 1:], None
        end = buf.rfind(b"\n")
        if end < 0:
            self.buf = buf
            return
        self.sink.lines(self.conn, self.out, buf[:end].split(b"\n"), ts)
        self.buf = buf[end + 1:]

    def scan(self) -> None:
        pass

    def gap(self, n: int, ts: int, pkt: int = 0) -> None:
        if self.buf:
            self.sink.fragment(self.conn, self.out, self.buf, ts,
                               f"line cut short: {n} bytes after it were lost by the capture")
            self.buf = b""
        self.resync = f"{n} bytes lost by the capture"

    def end(self, ts: int, why: str) -> None:
        if self.buf:
            self.sink.fragment(self.conn, self.out, self.buf, ts, f"{why} inside this line (no newline)")
            self.buf = b""


class RespFramer:
    """One direction of a Redis connection carrying Synapse's replication (RESP2 pub/sub):
    from the server, `message` / `pmessage` pushes become `in` lines with their channel;
    from the client, `PUBLISH channel line` commands become `out` lines. Every other
    command and reply (SUBSCRIBE, AUTH, PING, confirmations, integers) is not recorded,
    so credentials never reach a capture. Bytes that are no RESP stop this direction,
    the rest of it one flagged row."""

    def __init__(self, sink, conn, out: bool, midstream: bool):
        self.sink, self.conn, self.out = sink, conn, out
        self.buf = b""
        self.broken: str | None = MIDSTREAM if midstream else None
        self.resync = self.broken

    def data(self, chunk, ts: int, pkt: int = 0) -> None:
        chunk = bytes(chunk)
        buf = self.buf + chunk if self.buf else chunk
        if self.resync is not None:       # a mid-stream start: from the first array header on
            m = _RESP_RE.search(buf) or re.compile(rb"\*[0-9]{1,3}\r\n").search(buf)
            if m is None:
                self.buf = buf[-16:]
                return
            if m.start():
                self.sink.fragment(self.conn, self.out, buf[:m.start()], ts, f"{self.resync}: not a whole RESP value")
            buf, self.resync = buf[m.start():], None
        pos = 0
        lines: list[tuple[str, bytes]] = []     # (channel, line)
        while True:
            got = _resp_value(buf, pos)
            if got is None:
                break
            value, pos = got
            self._take(value, lines)
        self.buf = buf[pos:]
        for channel, line in lines:
            self.sink.lines(self.conn, self.out, [line], ts, channel=channel)

    def _take(self, value, lines: list) -> None:
        if not isinstance(value, list) or not value or not all(isinstance(v, bytes) for v in value):
            return
        word = value[0].lower()
        if self.out and word == b"publish" and len(value) == 3:
            lines.append((value[1].decode("utf-8", "replace"), value[2]))
        elif not self.out and word == b"message" and len(value) == 3:
            lines.append((value[1].decode("utf-8", "replace"), value[2]))
        elif not self.out and word == b"pmessage" and len(value) == 4:
            lines.append((value[2].decode("utf-8", "replace"), value[3]))

    def scan(self) -> None:
        pass

    def gap(self, n: int, ts: int, pkt: int = 0) -> None:
        if self.buf:
            self.sink.fragment(self.conn, self.out, self.buf, ts,
                               f"RESP value cut short: {n} bytes after it were lost by the capture")
            self.buf = b""
        self.resync = f"{n} bytes lost by the capture"

    def end(self, ts: int, why: str) -> None:
        if self.buf:
            self.sink.fragment(self.conn, self.out, self.buf, ts, f"{why} inside this RESP value")
            self.buf = b""


def _resp_value(buf: bytes, pos: int, depth: int = 0):
    """(value, end) of the RESP2 value at buf[pos], or None when it is not whole yet.
    Arrays are lists, bulk strings bytes, anything else None (it is not recorded)."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0 or depth > 4:
        return None
    kind, head = buf[pos:pos + 1], buf[pos + 1:nl]
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return None, nl + 2
    try:
        n = int(head)
    except ValueError:
        return None
    if kind in (b"$", b"=", b"!"):
        if n < 0:
            return None, nl + 2
        end = nl + 2 + n
        return (buf[nl + 2:end], end + 2) if len(buf) >= end + 2 else None
    if kind in (b"*", b">", b"~", b"%"):
        items, at = [], nl + 2
        for _ in range(max(n, 0) * (2 if kind == b"%" else 1)):
            got = _resp_value(buf, at, depth + 1)
            if got is None:
                return None
            items.append(got[0])
            at = got[1]
        return items, at
    return None
