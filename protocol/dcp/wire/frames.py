"""The memcached binary framing: the 24-byte header (classic and flexible), framing extras,
and an incremental splitter that never blocks and never raises on a short buffer."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable

from dcptool.protocol.dcp.wire.constants import (
    ALL_MAGICS,
    DEFAULT_MAX_BODY,
    FLEX_MAGICS,
    HEADER_LEN,
    RESPONSE_MAGICS,
    FrameInfoId,
)
from dcptool.protocol.errors import ErrorCode, LocalError, RemoteError

_HDR = struct.Struct(">BBHBBHIIQ")       # classic: magic opcode keylen extlen dt vb/status bodylen opaque cas
_FLEX = struct.Struct(">BBBBBBHIIQ")     # flexible: magic opcode felen keylen extlen dt vb/status bodylen opaque cas
_BODYLEN = struct.Struct(">I")
_Buf = bytes | bytearray | memoryview   # a receive buffer (or a capture's bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One whole frame, split into its parts. `raw` is the exact bytes on the wire."""
    magic: int
    opcode: int
    datatype: int
    vbucket_or_status: int
    opaque: int
    cas: int
    framing_extras: bytes
    extras: bytes
    key: bytes
    value: bytes
    raw: bytes

    @property
    def is_response(self) -> bool:
        return self.magic in RESPONSE_MAGICS

    @property
    def status(self) -> int | None:
        return self.vbucket_or_status if self.magic in RESPONSE_MAGICS else None

    @property
    def vbucket(self) -> int | None:
        return None if self.magic in RESPONSE_MAGICS else self.vbucket_or_status

    def frame_infos(self) -> list[tuple[int, bytes]]:
        return parse_frame_infos(self.framing_extras)

    @property
    def stream_id(self) -> int | None:
        return stream_id_of(self.framing_extras)


def parse_frame_infos(data: bytes) -> list[tuple[int, bytes]]:
    """Flexible-framing elements as (id, payload); unknown ids are kept."""
    out = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        i += 1
        fid, flen = b >> 4, b & 0x0F
        if fid == 15:
            if i >= n:
                raise RemoteError(ErrorCode.BAD_FRAMING_EXTRAS, "framing extras end inside an escaped id")
            fid = 15 + data[i]
            i += 1
        if flen == 15:
            if i >= n:
                raise RemoteError(ErrorCode.BAD_FRAMING_EXTRAS, "framing extras end inside an escaped length")
            flen = 15 + data[i]
            i += 1
        if i + flen > n:
            raise RemoteError(ErrorCode.BAD_FRAMING_EXTRAS,
                              f"framing element {fid} needs {flen} bytes, {n - i} left")
        out.append((fid, bytes(data[i:i + flen])))
        i += flen
    return out


def encode_frame_infos(infos: Iterable[tuple[int, bytes]]) -> bytes:
    out = bytearray()
    for fid, payload in infos:
        flen = len(payload)
        first = (min(fid, 15) << 4) | min(flen, 15)
        out.append(first)
        if fid >= 15:
            out.append(fid - 15)
        if flen >= 15:
            out.append(flen - 15)
        out += payload
    return bytes(out)


def stream_id_of(framing_extras: bytes) -> int | None:
    if not framing_extras:
        return None
    if framing_extras[0] == 0x22 and len(framing_extras) >= 3:  # the common case, no loop
        return (framing_extras[1] << 8) | framing_extras[2]
    for fid, payload in parse_frame_infos(framing_extras):
        if fid == FrameInfoId.DCP_STREAM_ID and len(payload) == 2:
            return (payload[0] << 8) | payload[1]
    return None


def header_lengths(buf: _Buf, pos: int = 0) -> tuple[int, int, int, int]:
    """(framing extras length, extras length, key length, body length) of the header at pos."""
    magic = buf[pos]
    if magic in FLEX_MAGICS:
        fe, kl = buf[pos + 2], buf[pos + 3]
    else:
        fe, kl = 0, (buf[pos + 2] << 8) | buf[pos + 3]
    return fe, buf[pos + 4], kl, _BODYLEN.unpack_from(buf, pos + 8)[0]


def check_header(buf: _Buf, pos: int, max_body: int) -> int:
    """Validate the header at pos and return the whole frame length. Raises RemoteError."""
    magic = buf[pos]
    if magic not in ALL_MAGICS:
        raise RemoteError(ErrorCode.BAD_MAGIC, f"bad magic 0x{magic:02x} at byte {pos}")
    fe, el, kl, bl = header_lengths(buf, pos)
    if bl > max_body:
        raise RemoteError(ErrorCode.BODY_TOO_LARGE,
                          f"body length {bl} above the cap of {max_body} bytes at byte {pos}")
    if fe + el + kl > bl:
        raise RemoteError(ErrorCode.BAD_LENGTHS,
                          f"framing extras {fe} + extras {el} + key {kl} exceed body length {bl} at byte {pos}")
    return HEADER_LEN + bl


def split(buf: _Buf, max_body: int = DEFAULT_MAX_BODY, start: int = 0) -> tuple[list[tuple[int, int]], int]:
    """Frame boundaries in buf from start: ([(offset, length), ...], bytes consumed). A
    short tail is left unconsumed (need more data); a bad header raises RemoteError (use
    `split_until_error` to keep the frames before it)."""
    out, consumed, err = split_until_error(buf, max_body, start)
    if err is not None:
        raise err
    return out, consumed


def split_until_error(buf: _Buf, max_body: int = DEFAULT_MAX_BODY,
                      start: int = 0) -> tuple[list[tuple[int, int]], int, RemoteError | None]:
    """(boundaries, consumed, error or None): every frame before a bad header is kept."""
    out: list[tuple[int, int]] = []
    pos, n = start, len(buf)
    try:
        while pos + HEADER_LEN <= n:
            length = check_header(buf, pos, max_body)
            if pos + length > n:
                break
            out.append((pos, length))
            pos += length
    except RemoteError as exc:
        return out, pos - start, exc
    return out, pos - start, None


def parse_frame(buf: _Buf, pos: int = 0, length: int | None = None) -> Frame:
    """The frame at buf[pos:pos+length] (whole, already checked by split)."""
    magic = buf[pos]
    if magic in FLEX_MAGICS:
        _, opcode, fe, kl, el, dt, vs, bl, opaque, cas = _FLEX.unpack_from(buf, pos)
    else:
        _, opcode, kl, el, dt, vs, bl, opaque, cas = _HDR.unpack_from(buf, pos)
        fe = 0
    if length is None:
        length = HEADER_LEN + bl
    raw = bytes(buf[pos:pos + length])
    o = HEADER_LEN
    return Frame(magic, opcode, dt, vs, opaque, cas,
                 raw[o:o + fe], raw[o + fe:o + fe + el], raw[o + fe + el:o + fe + el + kl],
                 raw[o + fe + el + kl:], raw)


def encode_frame(magic: int, opcode: int, *, vbucket_or_status: int = 0, opaque: int = 0,
                 cas: int = 0, datatype: int = 0, framing_extras: bytes = b"",
                 extras: bytes = b"", key: bytes = b"", value: bytes = b"") -> bytes:
    if framing_extras and magic not in FLEX_MAGICS:
        magic = 0x18 if magic in RESPONSE_MAGICS else 0x08
    body_len = len(framing_extras) + len(extras) + len(key) + len(value)
    if magic in FLEX_MAGICS:
        if len(key) > 0xFF or len(framing_extras) > 0xFF:
            raise LocalError(ErrorCode.BAD_LENGTHS, "flexible framing allows at most 255 key bytes")
        hdr = _FLEX.pack(magic, opcode, len(framing_extras), len(key), len(extras), datatype,
                         vbucket_or_status, body_len, opaque, cas)
    else:
        if len(key) > 0xFFFF:
            raise LocalError(ErrorCode.BAD_LENGTHS, "key longer than 65535 bytes")
        hdr = _HDR.pack(magic, opcode, len(key), len(extras), datatype, vbucket_or_status,
                        body_len, opaque, cas)
    if len(extras) > 0xFF:
        raise LocalError(ErrorCode.BAD_LENGTHS, "extras longer than 255 bytes")
    return b"".join((hdr, framing_extras, extras, key, value))


class FrameParser:
    """Incremental: feed bytes, get whole frames. Keeps the unconsumed tail."""

    def __init__(self, max_body: int = DEFAULT_MAX_BODY):
        self.max_body = max_body
        self._buf = bytearray()

    def feed(self, data: _Buf) -> list[Frame]:
        self._buf += data
        bounds, consumed, err = split_until_error(self._buf, self.max_body)
        frames = [parse_frame(self._buf, off, ln) for off, ln in bounds]
        del self._buf[:consumed]
        if err is not None:
            # the frames before the bad header are returned through the error: an attribute
            # of this raise only, which RemoteError (protocol/errors.py) does not declare
            err.frames = frames  # type: ignore[attr-defined]
            raise err
        return frames

    @property
    def pending(self) -> int:
        """Bytes held that do not yet make a whole frame."""
        return len(self._buf)
