"""The fixed layouts of DCP message bodies (struct formats of extras and values) and the key's
collection prefix: what the decoder (message_codec.py) and the encoder (message_writers.py)
share."""

from __future__ import annotations

import struct

from dcptool.protocol.dcp.wire import leb128
from dcptool.protocol.dcp.wire.message_types import ItemMessage

U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
OPEN = struct.Struct(">II")
STREAM_REQ = struct.Struct(">IIQQQQQ")
SNAP_V1 = struct.Struct(">QQI")
SNAP_V20 = struct.Struct(">QQIQQ")
SNAP_V22 = struct.Struct(">QQIQQQ")
SNAP_V22_HPS = struct.Struct(">QQIQQQQ")
MUTATION = struct.Struct(">QQIIIHB")
DELETION_V1 = struct.Struct(">QQH")
DELETION_V2 = struct.Struct(">QQIB")
EXPIRATION = struct.Struct(">QQI")
SYSTEM_EVENT = struct.Struct(">QIB")
PREPARE = struct.Struct(">QQIIIBBB")
TWO_SEQNOS = struct.Struct(">QQ")
PAIR = struct.Struct(">QQ")
VB_SEQNO = struct.Struct(">HQ")
WITH_META = struct.Struct(">IIQQ")     # flags, expiration, rev seqno, CAS (+ options u32, + meta length u16)
META = struct.Struct(">IIIQ")          # GET_META answer: deleted, flags, expiration, rev seqno (+ datatype)

Parts = tuple[int, bytes, bytes, bytes]     # (vbucket or status, extras, key, value) of a frame


def join_key(msg: ItemMessage) -> bytes:
    """The key as on the wire: the collection id (LEB128) before it when collections are on."""
    if msg.collection_id is None:
        return msg.key
    return leb128.encode(msg.collection_id) + msg.key
