"""Unsigned LEB128, as Couchbase prefixes keys with their collection id (canonical form
only, at most 5 bytes for a u32)."""

from __future__ import annotations

from dcptool.protocol.errors import ErrorCode, RemoteError


def encode(value: int) -> bytes:
    if value < 0 or value > 0xFFFFFFFF:
        raise ValueError(f"collection id {value} outside u32")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode(data: bytes | bytearray | memoryview, pos: int = 0, limit: int | None = None) -> tuple[int, int]:
    """(value, bytes used) of the LEB128 number at data[pos:limit]."""
    end = len(data) if limit is None else limit
    if pos < end and data[pos] < 0x80:  # the common one-byte case
        return data[pos], 1
    value = shift = 0
    i = pos
    while i < end and i - pos < 5:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            used = i - pos
            if used > 1 and byte == 0:
                raise RemoteError(ErrorCode.BAD_LEB128, "collection id is not in shortest LEB128 form")
            if value > 0xFFFFFFFF:
                raise RemoteError(ErrorCode.BAD_LEB128, "collection id above u32")
            return value, used
        shift += 7
    raise RemoteError(ErrorCode.BAD_LEB128, "key ends inside its LEB128 collection id")
