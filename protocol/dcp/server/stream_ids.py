"""Stream IDs on the producer side, sans-IO (DCP_DIGEST §1.1-1.2, §3, §4): the `sid` of a
stream request value, and the rewriting of a stream's encoded frames into the alt-request
framing kv_engine uses for a stream with an id: magic 0x08, framing extras = the 3-byte
frame info `0x22 <sid u16 BE>`, key length in one byte, body length + 3.

The producer's streams queue already-encoded frames (producer_streams.py: Fixed disk blobs
and Var frame lists); a segment of a stream with an id is rewritten once, before its first
byte leaves, so flow control counts the 3 extra bytes of every frame as kv_engine does.
Prepare, commit and abort never carry a stream id [CONN] (and enable_stream_id is refused
with sync writes anyway): they pass unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from dcptool.protocol.dcp.server.streams import Fixed, Var
from dcptool.protocol.dcp.wire.constants import Opcode, Status, stream_key  # noqa: F401 (the producer's stream key)

SID_FRAME_LEN = 3
# producer messages that carry the stream id: stream end, snapshot marker, mutation, deletion,
# expiration, system event, seqno advanced, OSO snapshot
TAGGED_OPS = frozenset(int(o) for o in (Opcode.DCP_STREAM_END, Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_MUTATION,
                                        Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION, Opcode.DCP_SYSTEM_EVENT,
                                        Opcode.DCP_SEQNO_ADVANCED, Opcode.DCP_OSO_SNAPSHOT))
MAX_SID = 0xFFFF


def split_sid(value: bytes, enabled: bool) -> tuple[int, int, bytes]:
    """(status, sid, value without `sid`) of a STREAM_REQ value. With stream ids enabled the
    value must carry a `sid` of 1..65535; without, it must not carry one (kv_engine answers
    DCP_STREAM_ID_INVALID either way). A value that is not JSON is left to the filter parser."""
    doc: Any = None
    if value:
        try:
            doc = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            doc = None
    has = isinstance(doc, dict) and "sid" in doc
    if not enabled:
        return (Status.DCP_STREAM_ID_INVALID if has else Status.SUCCESS), 0, value
    if not has:
        return Status.DCP_STREAM_ID_INVALID, 0, value
    sid = doc.pop("sid")
    if type(sid) is not int or not 1 <= sid <= MAX_SID:
        return Status.DCP_STREAM_ID_INVALID, 0, value
    rest = json.dumps(doc, separators=(",", ":")).encode() if doc else b""
    return Status.SUCCESS, sid, rest


def tag_frame(frame: bytes | memoryview | npt.NDArray[np.uint8], sid: int) -> bytes:
    """One classic-framed producer message (magic 0x80) in alt framing with the stream id."""
    fr = bytes(frame)
    if fr[0] != 0x80 or fr[1] not in TAGGED_OPS or fr[2] != 0:
        return fr     # not a stream message, or a key too long for the one-byte length
    body = int.from_bytes(fr[8:12], "big") + SID_FRAME_LEN
    return b"".join((b"\x08", fr[1:2], b"\x03", fr[3:8], body.to_bytes(4, "big"), fr[12:24],
                     bytes((0x22, sid >> 8, sid & 0xFF)), fr[24:]))


def _tag_fixed(seg: Fixed, sid: int) -> Fixed | Var:
    f, n = seg.f, seg.n - seg.i
    old = np.frombuffer(seg.data[seg.i * f:seg.n * f], dtype=np.uint8).reshape(n, f)
    if n == 0 or not ((old[:, 0] == 0x80) & np.isin(old[:, 1], sorted(TAGGED_OPS)) & (old[:, 2] == 0)).all():
        return Var.of_blob(*_joined([tag_frame(old[i], sid) for i in range(n)]))
    new = np.empty((n, f + SID_FRAME_LEN), dtype=np.uint8)
    new[:, 0] = 0x08
    new[:, 1] = old[:, 1]
    new[:, 2] = SID_FRAME_LEN
    new[:, 3:8] = old[:, 3:8]
    body = old[:, 8:12].copy().view(">u4").reshape(n) + SID_FRAME_LEN
    new[:, 8:12] = body.astype(">u4").view(np.uint8).reshape(n, 4)
    new[:, 12:24] = old[:, 12:24]
    new[:, 24] = 0x22
    new[:, 25] = sid >> 8
    new[:, 26] = sid & 0xFF
    new[:, 27:] = old[:, 24:]
    return Fixed(new.tobytes(), f + SID_FRAME_LEN, n, seg.data_frames)


def _joined(frames: list[bytes]) -> tuple[bytes, list[int]]:
    starts = [0]
    for fr in frames:
        starts.append(starts[-1] + len(fr))
    return b"".join(frames), starts


def tag_segment(seg: Fixed | Var, sid: int) -> Fixed | Var:
    """The not-yet-sent rest of a segment, every stream message in it tagged with sid."""
    if isinstance(seg, Fixed):
        return _tag_fixed(seg, sid)
    if isinstance(seg, Var):
        s, data = seg.starts, seg.data
        return Var.of_blob(*_joined([tag_frame(data[s[i]:s[i + 1]], sid) for i in range(seg.i, len(s) - 1)]))
    return seg
