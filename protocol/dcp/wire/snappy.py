"""Raw (unframed) Snappy as Couchbase sends values (datatype bit 0x02), bounded: the length a
block announces in its varint preamble is checked against a limit before anything is
allocated, so a hostile preamble never costs memory. cramjam does the decompression."""

from __future__ import annotations

from dcptool.protocol.errors import DcptoolError


class TooLarge(DcptoolError, ValueError):
    """The block announces more bytes than the caller allows."""


def announced_length(b: bytes) -> int:
    """The uncompressed length a raw Snappy block announces; ValueError when the preamble
    is not a varint of at most 5 bytes."""
    n = shift = 0
    for i in range(min(len(b), 5)):
        n |= (b[i] & 0x7F) << shift
        if not b[i] & 0x80:
            return n
        shift += 7
    raise ValueError("bad length header")


def decompress(b: bytes, limit: int) -> bytes:
    """The block decompressed. TooLarge when it announces more than `limit` bytes;
    ValueError (one line) when it does not decompress, or to another length than announced."""
    import cramjam
    n = announced_length(b)
    if n > limit:
        raise TooLarge(f"uncompressed length {n} over {limit}")
    try:
        out = bytes(cramjam.snappy.decompress_raw(b))
    except Exception as exc:  # noqa: BLE001 - cramjam raises its own DecompressionError
        msg = (str(exc).splitlines() or ["corrupt input"])[0]
        raise ValueError(msg[8:] if msg.lower().startswith("snappy: ") else msg) from None
    if len(out) != n:
        raise ValueError("length does not match its header")
    return out
