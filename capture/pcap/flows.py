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


def _sane_headers(window: np.ndarray, max_body: int = DEFAULT_MAX_BODY) -> np.ndarray:
    """Offsets in `window` (bytes as uint8, of which the last 23 only complete a header) where
    a memcached header could start by its own fields: a magic, a datatype, a body length
    under the cap that holds the framing extras, extras and key. One vectorised pass."""
    at = np.flatnonzero(_MAGIC_TABLE[window[:len(window) - 23]])
    if not len(at):
        return at
    magic = window[at]
    alt = (magic == 0x08) | (magic == 0x18)
    b2, b3 = window[at + 2].astype(np.int64), window[at + 3].astype(np.int64)
    framing = np.where(alt, b2, 0)
    keylen = np.where(alt, b3, (b2 << 8) | b3)
    body = ((window[at + 8].astype(np.int64) << 24) | (window[at + 9].astype(np.int64) << 16)
            | (window[at + 10].astype(np.int64) << 8) | window[at + 11].astype(np.int64))
    ok = (window[at + 5] <= 0x07) & (body <= max_body) & (framing + window[at + 4] + keylen <= body)
    sane: np.ndarray = at[ok]
    return sane


def _sane_at(buf: bytes | bytearray, i: int, max_body: int) -> bool:
    """`_sane_headers` of the one offset i (the header after a candidate's frame)."""
    magic = buf[i]
    if magic not in MAGICS:
        return False
    framing, keylen = (buf[i + 2], buf[i + 3]) if magic in (0x08, 0x18) else (0, (buf[i + 2] << 8) | buf[i + 3])
    body = int.from_bytes(buf[i + 8:i + 12], "big")
    return buf[i + 5] <= 0x07 and body <= max_body and framing + buf[i + 4] + keylen <= body


_MAGIC_TABLE = np.zeros(256, dtype=bool)
_MAGIC_TABLE[sorted(MAGICS)] = True
RESYNC_STEP = 64 * 2**10    # new bytes scanned together (numpy's cost per call is paid per step, not per packet)


class Resync:
    """The first whole frame after bytes that are no frames (a hole, a mid-stream start, a
    bad header), found in work linear in the bytes (sans-IO). Each byte is looked at once by a
    vectorised pass for headers plausible by their own fields (`_sane_headers`); each such
    candidate, in order, is then decided once: it is the frame when its frame is whole and the
    bytes after it start a plausible header too (or, at the end of the data, end exactly
    there), ruled out when they do not, and waited for (no new scan) while its frame is not
    whole yet. `work` counts the bytes scanned and the candidates decided."""

    def __init__(self, start: int = 0, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.base = 0                 # bytes cut from the front of the buffer since the start
        self.scanned = start          # absolute: every offset below it is a candidate or ruled out
        self.pending: list[int] = []  # absolute offsets of candidates not decided, in order
        self.first = 0                # index into pending of the first one
        self.max_body = max_body
        self.work = 0
        self.wait_until = 0           # absolute: the bytes the first candidate needs to be decided

    def find(self, buf: bytes | bytearray, final: bool = False) -> int | None:
        """The offset in `buf` of the first whole frame, or None while more data is needed."""
        n, base = len(buf), self.base
        lo = self.scanned - base
        if not final and (base + n < self.wait_until
                          or (self.first >= len(self.pending) and n - lo < RESYNC_STEP)):
            return None               # nothing to decide yet, or too few new bytes for a pass
        if n - lo >= 24:
            window = np.frombuffer(bytes(buf[lo:n]), dtype=np.uint8)
            self.pending.extend((_sane_headers(window, self.max_body) + self.scanned).tolist())
            self.work += n - 23 - lo
            self.scanned = base + n - 23
        while self.first < len(self.pending):
            i = self.pending[self.first] - base
            self.work += 1
            nxt = i + 24 + int.from_bytes(buf[i + 8:i + 12], "big")
            if nxt + 24 <= n:
                if _sane_at(buf, nxt, self.max_body):
                    return i
            elif final and nxt == n:
                return i
            elif not final:
                self.wait_until = base + nxt + 24
                return None           # its frame is not whole yet: wait, without scanning again
            self.first += 1
        return None

    def undecided(self, buf: bytes | bytearray) -> int:
        """Bytes at the front of `buf` that hold no candidate left to decide."""
        if self.first < len(self.pending):
            return self.pending[self.first] - self.base
        return max(0, min(len(buf), self.scanned - self.base))

    def cut(self, n: int) -> None:
        """The first `n` bytes of the buffer were given away."""
        self.base += n
        if self.first:
            del self.pending[:self.first]
            self.first = 0


class DcpFramer:
    """One direction of a memcached connection: frames out as whole frames. Bytes are
    held until SCAN_BYTES arrived (or the sink asks: `scan`), then cut in one pass; each
    frame gets the time and number of the packet that completed it (`marks`)."""

    def __init__(self, sink, conn, out: bool, midstream: bool):
        self.sink, self.conn, self.out = sink, conn, out
        self.buf = bytearray()
        self.marks: list[tuple[int, int, int]] = []   # (end offset in buf, ts, packet number)
        self.resync = MIDSTREAM if midstream else None
        self.finder: Resync | None = None
        self.resync_work = 0     # bytes and headers the resyncs of this direction examined

    def data(self, chunk, ts: int, pkt: int) -> None:
        self.buf += chunk
        self.marks.append((len(self.buf), ts, pkt))
        if self.resync is not None or len(self.buf) >= SCAN_BYTES:
            self.scan()

    def scan(self, final: bool = False) -> None:
        while self.buf:
            if self.resync is not None and not self._find_header(final):
                return
            offsets, lengths, consumed, err = columnar.scan(self.buf)
            if len(offsets):
                marks = np.array(self.marks, dtype=np.int64)
                at = np.searchsorted(marks[:, 0], offsets + lengths, side="left")
                self.sink.frames(self.conn, self.out, self._hand(consumed), offsets, lengths,
                                 marks[at, 1], marks[at, 2])
            if err is None:
                return
            self._end_resync()
            self.resync = f"not a frame header ({err})"
            # the header at 0 is no header: the search starts after it (never the same one again)
            self.finder = Resync(start=0 if consumed else 1)

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

    def _find_header(self, final: bool = False) -> bool:
        """Skip to the first whole frame after bytes that are no frames (Resync: bounded work);
        False while more data is needed to tell. Bytes before the first candidate not yet
        ruled out are given up as one fragment once they pass RESYNC_LIMIT."""
        if self.finder is None:
            self.finder = Resync()
        found = self.finder.find(self.buf, final)
        if found is not None:
            if found:
                self._fragment(found, f"{self.resync}: {found} bytes before the first whole frame skipped")
            self._end_resync()
            return True
        skip = self.finder.undecided(self.buf)
        if skip > RESYNC_LIMIT or (final and skip):
            self._fragment(skip, f"{self.resync}: {skip} bytes with no frame header skipped")
            self.finder.cut(skip)
        return False

    def _end_resync(self) -> None:
        if self.finder is not None:
            self.resync_work += self.finder.work
        self.resync, self.finder = None, None

    def gap(self, n: int, ts: int, pkt: int) -> None:
        self.scan()
        if self.buf:
            self._fragment(len(self.buf), f"frame cut short: {n} bytes after it were lost by the capture",
                           at=(ts, pkt))
        self.marks = []
        self._end_resync()
        self.resync = f"{n} bytes lost by the capture"

    def end(self, ts: int, why: str) -> None:
        self.scan(final=True)
        self._end_resync()
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
