"""The DCP messages (message_types.py) as CAPTURE_FORMAT rows: to_row(message) -> dict of
columns, value_bytes(message)."""

from __future__ import annotations

from typing import Any

from dcptool.protocol.dcp.wire.constants import DatatypeBit, op_name
from dcptool.protocol.dcp.wire.message_types import (
    Abort,
    Commit,
    Control,
    DcpOpen,
    Deletion,
    Expiration,
    FailoverLogResponse,
    Hello,
    ItemMessage,
    Message,
    Mutation,
    OsoSnapshot,
    Prepare,
    Request,
    Response,
    SaslAuth,
    SaslStep,
    SelectBucket,
    SeqnoAdvanced,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    StreamRequestResponse,
    SystemEvent,
)

# --------------------------------------------------------------------------- rows

_ROW_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {
    Mutation: (("by_seqno", "by_seqno"), ("rev_seqno", "rev_seqno"), ("item_flags", "item_flags"),
               ("expiration", "expiration"), ("lock_time", "lock_time")),
    Deletion: (("by_seqno", "by_seqno"), ("rev_seqno", "rev_seqno"), ("delete_time", "delete_time")),
    Expiration: (("by_seqno", "by_seqno"), ("rev_seqno", "rev_seqno"), ("delete_time", "delete_time")),
    Prepare: (("by_seqno", "by_seqno"), ("rev_seqno", "rev_seqno"), ("item_flags", "item_flags"),
              ("expiration", "expiration"), ("lock_time", "lock_time")),
    Commit: (("by_seqno", "commit_seqno"),),
    Abort: (("by_seqno", "abort_seqno"),),
    SnapshotMarker: (("snap_version", "snap_version"), ("snap_start", "snap_start"), ("snap_end", "snap_end"),
                     ("snap_flags", "snap_flags"), ("max_visible_seqno", "max_visible_seqno"),
                     ("high_completed_seqno", "high_completed_seqno"), ("purge_seqno", "purge_seqno"),
                     ("high_prepared_seqno", "high_prepared_seqno")),
    StreamEnd: (("stream_end_reason", "reason"),),
    SystemEvent: (("by_seqno", "by_seqno"), ("system_event_id", "event_id")),
    SeqnoAdvanced: (("by_seqno", "by_seqno"),),
    OsoSnapshot: (("snap_flags", "flags"),),      # 0x01 start, 0x02 end (CAPTURE_FORMAT.md)
    StreamRequest: (("req_flags", "flags"), ("req_start_seqno", "start_seqno"), ("req_end_seqno", "end_seqno"),
                    ("req_vbucket_uuid", "vbucket_uuid"), ("req_snap_start", "snap_start"),
                    ("req_snap_end", "snap_end")),
    StreamRequestResponse: (("rollback_seqno", "rollback_seqno"),),
}


_KEY_ATTR = {DcpOpen: "name", Hello: "agent", SaslAuth: "mechanism", SaslStep: "mechanism",
             SelectBucket: "bucket", Control: "key", SystemEvent: "key", Request: "key", Response: "key"}
_VALUE_ATTR = {DcpOpen: "value", SaslAuth: "data", SaslStep: "data", Control: "value",
               SystemEvent: "value", StreamRequest: "value", Request: "value", Response: "value",
               StreamRequestResponse: "value", FailoverLogResponse: "value"}


def _request_sid(value: bytes) -> int | None:
    """The `sid` (1..65535) of a STREAM_REQ value, or None."""
    import json
    try:
        sid = json.loads(value).get("sid")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return sid if type(sid) is int and 0 < sid <= 0xFFFF else None


def to_row(m: Message, raw: bytes | None = None, *, value: bool = False) -> dict[str, Any]:
    """CAPTURE_FORMAT columns of a message (only the ones it carries). `raw` adds the frame
    bytes; `value` adds the value bytes under `value` (not a capture column)."""
    magic = m.wire_magic()
    op = m.op_code
    row: dict[str, Any] = {"magic": magic, "opcode": op, "op": op_name(op, magic)}
    if m.IS_RESPONSE:
        row["status"] = getattr(m, "status", 0)
    else:
        row["vbucket"] = getattr(m, "vbucket", 0)
    row["opaque"] = m.opaque
    row["cas"] = m.cas
    row["datatype"] = m.datatype
    sid = m.stream_id
    if sid is None and type(m) is StreamRequest and b'"sid"' in m.value:
        sid = _request_sid(m.value)     # a stream request names its stream id in its value
    if sid is not None:
        row["stream_id"] = sid
    t = type(m)
    if isinstance(m, ItemMessage):
        if m.collection_id is not None:
            row["collection_id"] = m.collection_id
        row["key"] = m.key
        row["value_len"] = len(m.value)
    else:
        attr = _KEY_ATTR.get(t)
        if attr is not None:
            row["key"] = getattr(m, attr)
        vattr = _VALUE_ATTR.get(t)
        if vattr is not None:
            row["value_len"] = len(getattr(m, vattr))
    for col, attr in _ROW_FIELDS.get(t, ()):
        v = getattr(m, attr)
        if v is not None:
            row[col] = v
    if type(m) is SystemEvent and m.event_id in (0, 1, 5) and m.version < 2 and len(m.value) >= 16:
        row["collection_id"] = int.from_bytes(m.value[12:16], "big")   # the collection it is about
    if type(m) is StreamRequestResponse or type(m) is FailoverLogResponse:
        if m.failover_log is not None:
            row["failover_log"] = [{"vbucket_uuid": u, "seqno": s} for u, s in m.failover_log]
    err = getattr(m, "decode_error", None)
    if err is not None:
        row["decode_error"] = err
    if value:
        vattr = "value" if isinstance(m, ItemMessage) else _VALUE_ATTR.get(t)
        if vattr is not None:
            v = getattr(m, vattr)
            # SASL payloads carry credentials: shown as '*' bytes of the same length
            row["value"] = b"*" * len(v) if t is SaslAuth or t is SaslStep else v
    if raw is not None:
        row["raw"] = raw
    return row


def value_bytes(m: Message) -> bytes:
    """The value as stored: Snappy-compressed values (datatype 0x02) are decompressed."""
    v: bytes = getattr(m, "value", b"")
    if m.datatype & DatatypeBit.SNAPPY and v:
        import cramjam
        return bytes(cramjam.snappy.decompress_raw(v))
    return v
