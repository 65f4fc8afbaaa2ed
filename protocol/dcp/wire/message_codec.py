"""The wire codec of the DCP messages (message_types.py): decode(frame) -> message,
encode(message) -> bytes.

encode(decode(b)) == b for every valid frame. A frame of a known opcode whose layout is
wrong decodes to a generic Request or Response carrying `decode_error`; nothing raises on
bad input except framing errors."""

from __future__ import annotations

import struct

from dcptool.protocol.dcp.wire import leb128
from dcptool.protocol.dcp.wire.constants import RESPONSE_MAGICS, Status, op_name
from dcptool.protocol.dcp.wire.frames import Frame, encode_frame, encode_frame_infos, parse_frame, parse_frame_infos
from dcptool.protocol.dcp.wire.message_types import (Message, Request, Response, Hello, HelloResponse,
                                                SaslListMechs, SaslAuth, SaslStep, SelectBucket,
                                                GetErrorMap, DcpOpen, AddStream, CloseStream,
                                                StreamRequest, StreamRequestResponse,
                                                GetFailoverLog, FailoverLogResponse, StreamEnd,
                                                SnapshotMarker, Mutation, Deletion, Expiration,
                                                SetVbucketState, Noop, BufferAck, Control,
                                                SystemEvent, Prepare, SeqnoAcknowledged, Commit,
                                                Abort, SeqnoAdvanced, OsoSnapshot, GetAllVbSeqnos,
                                                GetAllVbSeqnosResponse)
from dcptool.protocol.errors import DcptoolError, ErrorCode, ProtocolError

# --------------------------------------------------------------------------- layouts

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_OPEN = struct.Struct(">II")
_STREAM_REQ = struct.Struct(">IIQQQQQ")
_SNAP_V1 = struct.Struct(">QQI")
_SNAP_V20 = struct.Struct(">QQIQQ")
_SNAP_V22 = struct.Struct(">QQIQQQ")
_SNAP_V22_HPS = struct.Struct(">QQIQQQQ")
_MUTATION = struct.Struct(">QQIIIHB")
_DELETION_V1 = struct.Struct(">QQH")
_DELETION_V2 = struct.Struct(">QQIB")
_EXPIRATION = struct.Struct(">QQI")
_SYSTEM_EVENT = struct.Struct(">QIB")
_PREPARE = struct.Struct(">QQIIIBBB")
_TWO_SEQNOS = struct.Struct(">QQ")
_PAIR = struct.Struct(">QQ")
_VB_SEQNO = struct.Struct(">HQ")

SNAPSHOT_VERSIONS = {0: "2.0", 2: "2.2"}


class _Bad(DcptoolError):
    """A known opcode with a wrong layout: decoded to the generic form with this reason."""

    def __init__(self, code: ErrorCode, text: str):
        super().__init__(f"{code.name.lower()}: {text}")


def _need(extras: bytes, size: int, what: str) -> None:
    if len(extras) != size:
        raise _Bad(ErrorCode.BAD_EXTRAS, f"{what} needs {size} extras bytes, got {len(extras)}")


def _pairs(value: bytes, what: str) -> tuple[tuple[int, int], ...]:
    if len(value) % 16:
        raise _Bad(ErrorCode.BAD_LENGTHS, f"{what} of {len(value)} bytes is not a list of 16-byte entries")
    return tuple(_PAIR.iter_unpack(value))


def _split_key(key: bytes, collections: bool) -> tuple[int | None, bytes]:
    if not collections:
        return None, key
    try:
        cid, used = leb128.decode(key)
    except ProtocolError as exc:
        raise _Bad(exc.code, exc.message) from None
    return cid, key[used:]


def _join_key(msg) -> bytes:
    if msg.collection_id is None:
        return msg.key
    return leb128.encode(msg.collection_id) + msg.key


def _common(f: Frame) -> dict:
    infos = tuple(parse_frame_infos(f.framing_extras)) if f.framing_extras else ()
    default = (0x18 if f.magic in RESPONSE_MAGICS else 0x08) if infos else \
        (0x81 if f.magic in RESPONSE_MAGICS else 0x80)
    return {"opaque": f.opaque, "cas": f.cas, "datatype": f.datatype, "frame_infos": infos,
            "magic": None if f.magic == default else f.magic}


def _req_decoder(f: Frame, c: dict, collections: bool):
    op, ex, key, val, vb = f.opcode, f.extras, f.key, f.value, f.vbucket_or_status
    if op == 0x57:
        _need(ex, 31, "mutation")
        by, rev, fl, exp, lock, nmeta, nru = _MUTATION.unpack(ex)
        cid, k = _split_key(key, collections)
        return Mutation(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                        item_flags=fl, expiration=exp, lock_time=lock, nmeta=nmeta, nru=nru, **c)
    if op == 0x56:
        if len(ex) == 20:
            if val:
                raise _Bad(ErrorCode.BAD_LENGTHS, "snapshot marker V1 carries no value")
            s, e, fl = _SNAP_V1.unpack(ex)
            return SnapshotMarker(vbucket=vb, snap_version="1", snap_start=s, snap_end=e, snap_flags=fl, **c)
        if len(ex) != 1:
            raise _Bad(ErrorCode.BAD_EXTRAS, f"snapshot marker extras of {len(ex)} bytes (want 20 or 1)")
        version = SNAPSHOT_VERSIONS.get(ex[0])
        if version is None:
            raise _Bad(ErrorCode.BAD_EXTRAS, f"snapshot marker version {ex[0]} unknown")
        if version == "2.0":
            if len(val) != 36:
                raise _Bad(ErrorCode.BAD_LENGTHS, f"snapshot marker V2.0 value of {len(val)} bytes (want 36)")
            s, e, fl, mvs, hcs = _SNAP_V20.unpack(val)
            return SnapshotMarker(vbucket=vb, snap_version=version, snap_start=s, snap_end=e, snap_flags=fl,
                                  max_visible_seqno=mvs, high_completed_seqno=hcs, **c)
        if len(val) == 44:
            s, e, fl, mvs, hcs, ps = _SNAP_V22.unpack(val)
            hps = None
        elif len(val) == 52:
            s, e, fl, mvs, hcs, ps, hps = _SNAP_V22_HPS.unpack(val)
        else:
            raise _Bad(ErrorCode.BAD_LENGTHS, f"snapshot marker V2.2 value of {len(val)} bytes (want 44 or 52)")
        return SnapshotMarker(vbucket=vb, snap_version=version, snap_start=s, snap_end=e, snap_flags=fl,
                              max_visible_seqno=mvs, high_completed_seqno=hcs, purge_seqno=ps,
                              high_prepared_seqno=hps, **c)
    if op == 0x5C:
        _need(ex, 0, "noop")
        if key or val:
            raise _Bad(ErrorCode.BAD_LENGTHS, "noop carries no key or value")
        return Noop(vbucket=vb, **c)
    if op == 0x58:
        cid, k = _split_key(key, collections)
        if len(ex) == 18:
            by, rev, nmeta = _DELETION_V1.unpack(ex)
            return Deletion(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                            nmeta=nmeta, **c)
        if len(ex) == 21:
            by, rev, dt, unused = _DELETION_V2.unpack(ex)
            return Deletion(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                            delete_time=dt, unused=unused, **c)
        raise _Bad(ErrorCode.BAD_EXTRAS, f"deletion needs 18 or 21 extras bytes, got {len(ex)}")
    if op == 0x59:
        _need(ex, 20, "expiration")
        by, rev, dt = _EXPIRATION.unpack(ex)
        cid, k = _split_key(key, collections)
        return Expiration(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                          delete_time=dt, **c)
    if op == 0x55:
        _need(ex, 4, "stream end")
        return StreamEnd(vbucket=vb, reason=_U32.unpack(ex)[0], **c)
    if op == 0x53:
        _need(ex, 48, "stream request")
        fl, res, st, en, uuid, ss, se = _STREAM_REQ.unpack(ex)
        if key:
            raise _Bad(ErrorCode.BAD_LENGTHS, "stream request carries no key")
        return StreamRequest(vbucket=vb, flags=fl, reserved=res, start_seqno=st, end_seqno=en,
                             vbucket_uuid=uuid, snap_start=ss, snap_end=se, value=val, **c)
    if op == 0x5D:
        _need(ex, 4, "buffer acknowledgement")
        return BufferAck(vbucket=vb, bytes_acked=_U32.unpack(ex)[0], **c)
    if op == 0x5F:
        _need(ex, 13, "system event")
        by, ev, ver = _SYSTEM_EVENT.unpack(ex)
        return SystemEvent(vbucket=vb, by_seqno=by, event_id=ev, version=ver, key=key, value=val, **c)
    if op == 0x64:
        _need(ex, 8, "seqno advanced")
        return SeqnoAdvanced(vbucket=vb, by_seqno=_U64.unpack(ex)[0], **c)
    if op == 0x65:
        _need(ex, 4, "oso snapshot")
        return OsoSnapshot(vbucket=vb, flags=_U32.unpack(ex)[0], **c)
    if op == 0x60:
        _need(ex, 31, "prepare")
        by, rev, fl, exp, lock, nru, deleted, dur = _PREPARE.unpack(ex)
        cid, k = _split_key(key, collections)
        return Prepare(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                       item_flags=fl, expiration=exp, lock_time=lock, nru=nru, deleted=deleted,
                       durability=dur, **c)
    if op in (0x62, 0x63):
        _need(ex, 16, op_name(op))
        p, s = _TWO_SEQNOS.unpack(ex)
        cid, k = _split_key(key, collections)
        if op == 0x62:
            return Commit(vbucket=vb, key=k, collection_id=cid, value=val, prepared_seqno=p, commit_seqno=s, **c)
        return Abort(vbucket=vb, key=k, collection_id=cid, value=val, prepared_seqno=p, abort_seqno=s, **c)
    if op == 0x61:
        _need(ex, 8, "seqno acknowledged")
        return SeqnoAcknowledged(vbucket=vb, prepared_seqno=_U64.unpack(ex)[0], **c)
    if op == 0x5B:
        _need(ex, 1, "set vbucket state")
        return SetVbucketState(vbucket=vb, state=ex[0], **c)
    if op == 0x5E:
        _need(ex, 0, "control")
        return Control(vbucket=vb, key=key, value=val, **c)
    if op == 0x50:
        _need(ex, 8, "open")
        seq, fl = _OPEN.unpack(ex)
        return DcpOpen(vbucket=vb, name=key, flags=fl, seqno=seq, value=val, **c)
    if op == 0x51:
        _need(ex, 4, "add stream")
        return AddStream(vbucket=vb, flags=_U32.unpack(ex)[0], **c)
    if op == 0x52 or op == 0x54 or op == 0x20:
        _need(ex, 0, op_name(op))
        if key or val:
            raise _Bad(ErrorCode.BAD_LENGTHS, f"{op_name(op)} carries no key or value")
        cls = {0x52: CloseStream, 0x54: GetFailoverLog, 0x20: SaslListMechs}[op]
        return cls(vbucket=vb, **c)
    if op == 0x1F:
        _need(ex, 0, "hello")
        if len(val) % 2:
            raise _Bad(ErrorCode.BAD_LENGTHS, "hello features are not a list of u16")
        return Hello(vbucket=vb, agent=key, features=tuple(x for (x,) in _U16.iter_unpack(val)), **c)
    if op in (0x21, 0x22):
        _need(ex, 0, op_name(op))
        cls = SaslAuth if op == 0x21 else SaslStep
        return cls(vbucket=vb, mechanism=key, data=val, **c)
    if op == 0x89:
        _need(ex, 0, "select bucket")
        if val:
            raise _Bad(ErrorCode.BAD_LENGTHS, "select bucket carries no value")
        return SelectBucket(vbucket=vb, bucket=key, **c)
    if op == 0xFE:
        if ex or key or len(val) != 2:
            raise _Bad(ErrorCode.BAD_LENGTHS, "get error map carries a 2-byte version only")
        return GetErrorMap(vbucket=vb, version=_U16.unpack(val)[0], **c)
    if op == 0x48:
        if key or val or len(ex) not in (0, 4, 8):
            raise _Bad(ErrorCode.BAD_EXTRAS, "get all vb seqnos takes 0, 4 or 8 extras bytes only")
        return GetAllVbSeqnos(vbucket=vb, extras=ex, **c)
    return None


def _rsp_decoder(f: Frame, c: dict):
    op, st, ex, key, val = f.opcode, f.vbucket_or_status, f.extras, f.key, f.value
    if op == 0x53 and not ex and not key:
        if st == Status.SUCCESS:
            return StreamRequestResponse(status=st, failover_log=_pairs(val, "failover log"), **c)
        if st == Status.ROLLBACK:
            if len(val) != 8:
                raise _Bad(ErrorCode.BAD_LENGTHS, f"rollback answer of {len(val)} bytes (want 8)")
            return StreamRequestResponse(status=st, rollback_seqno=_U64.unpack(val)[0], **c)
        return StreamRequestResponse(status=st, value=val, **c)
    if op == 0x54 and not ex and not key:
        if st == Status.SUCCESS:
            return FailoverLogResponse(status=st, failover_log=_pairs(val, "failover log"), **c)
        return FailoverLogResponse(status=st, value=val, **c)
    if op == 0x1F and st == Status.SUCCESS and not ex and not key and len(val) % 2 == 0:
        return HelloResponse(status=st, features=tuple(x for (x,) in _U16.iter_unpack(val)), **c)
    if op == 0x48 and st == Status.SUCCESS and not ex and not key:
        if len(val) % 10:
            raise _Bad(ErrorCode.BAD_LENGTHS, "vb seqnos are not a list of 10-byte entries")
        return GetAllVbSeqnosResponse(status=st, seqnos=tuple(_VB_SEQNO.iter_unpack(val)), **c)
    return None


def decode(frame: Frame, collections: bool = False) -> Message:
    """The message in a whole frame. Never raises: a wrong layout gives a generic
    Request/Response with decode_error set."""
    try:
        c = _common(frame)
    except ProtocolError as exc:
        return _generic(frame, None, f"{exc.code.name.lower()}: {exc.message}")
    try:
        if frame.magic in RESPONSE_MAGICS:
            msg = _rsp_decoder(frame, c)
        else:
            msg = _req_decoder(frame, c, collections)
    except _Bad as bad:
        return _generic(frame, c, str(bad))
    return msg if msg is not None else _generic(frame, c, None)


def _generic(f: Frame, c: dict | None, error: str | None) -> Message:
    raw_framing = b""
    if c is None:  # framing extras that do not parse are kept raw
        c = {"opaque": f.opaque, "cas": f.cas, "datatype": f.datatype, "frame_infos": (),
             "magic": f.magic}
        raw_framing = f.framing_extras
    if f.magic in RESPONSE_MAGICS:
        return Response(status=f.vbucket_or_status, opcode=f.opcode, extras=f.extras, key=f.key,
                        value=f.value, decode_error=error, raw_framing=raw_framing, **c)
    return Request(vbucket=f.vbucket_or_status, opcode=f.opcode, extras=f.extras, key=f.key,
                   value=f.value, decode_error=error, raw_framing=raw_framing, **c)


def decode_bytes(data: bytes, collections: bool = False) -> Message:
    """Decode exactly one whole frame given as bytes."""
    return decode(parse_frame(data, 0, len(data)), collections)


# --------------------------------------------------------------------------- encode

def _parts(m: Message) -> tuple[int, bytes, bytes, bytes]:
    """(vbucket or status, extras, key, value) of a message."""
    t = type(m)
    if t is Mutation:
        return m.vbucket, _MUTATION.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration,
                                         m.lock_time, m.nmeta, m.nru), _join_key(m), m.value
    if t is SnapshotMarker:
        if m.snap_version == "1":
            return m.vbucket, _SNAP_V1.pack(m.snap_start, m.snap_end, m.snap_flags), b"", b""
        if m.snap_version == "2.0":
            return m.vbucket, b"\x00", b"", _SNAP_V20.pack(m.snap_start, m.snap_end, m.snap_flags,
                                                          m.max_visible_seqno or 0, m.high_completed_seqno or 0)
        if m.snap_version == "2.2":
            base = (m.snap_start, m.snap_end, m.snap_flags, m.max_visible_seqno or 0,
                    m.high_completed_seqno or 0, m.purge_seqno or 0)
            if m.high_prepared_seqno is None:
                return m.vbucket, b"\x02", b"", _SNAP_V22.pack(*base)
            return m.vbucket, b"\x02", b"", _SNAP_V22_HPS.pack(*base, m.high_prepared_seqno)
        raise ValueError(f"snapshot marker version {m.snap_version!r}")
    if t is Deletion:
        if m.delete_time is None:
            ex = _DELETION_V1.pack(m.by_seqno, m.rev_seqno, m.nmeta)
        else:
            ex = _DELETION_V2.pack(m.by_seqno, m.rev_seqno, m.delete_time, m.unused)
        return m.vbucket, ex, _join_key(m), m.value
    if t is Expiration:
        return m.vbucket, _EXPIRATION.pack(m.by_seqno, m.rev_seqno, m.delete_time), _join_key(m), m.value
    if t is Noop or t is CloseStream or t is GetFailoverLog or t is SaslListMechs:
        return m.vbucket, b"", b"", b""
    if t is StreamEnd:
        return m.vbucket, _U32.pack(m.reason), b"", b""
    if t is StreamRequest:
        return m.vbucket, _STREAM_REQ.pack(m.flags, m.reserved, m.start_seqno, m.end_seqno,
                                           m.vbucket_uuid, m.snap_start, m.snap_end), b"", m.value
    if t is StreamRequestResponse:
        if m.failover_log is not None:
            return m.status, b"", b"", b"".join(_PAIR.pack(u, s) for u, s in m.failover_log)
        if m.rollback_seqno is not None:
            return m.status, b"", b"", _U64.pack(m.rollback_seqno)
        return m.status, b"", b"", m.value
    if t is FailoverLogResponse:
        if m.failover_log is not None:
            return m.status, b"", b"", b"".join(_PAIR.pack(u, s) for u, s in m.failover_log)
        return m.status, b"", b"", m.value
    if t is BufferAck:
        return m.vbucket, _U32.pack(m.bytes_acked), b"", b""
    if t is Control:
        return m.vbucket, b"", m.key, m.value
    if t is SystemEvent:
        return m.vbucket, _SYSTEM_EVENT.pack(m.by_seqno, m.event_id, m.version), m.key, m.value
    if t is SeqnoAdvanced:
        return m.vbucket, _U64.pack(m.by_seqno), b"", b""
    if t is OsoSnapshot:
        return m.vbucket, _U32.pack(m.flags), b"", b""
    if t is Prepare:
        return m.vbucket, _PREPARE.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration, m.lock_time,
                                        m.nru, m.deleted, m.durability), _join_key(m), m.value
    if t is Commit:
        return m.vbucket, _TWO_SEQNOS.pack(m.prepared_seqno, m.commit_seqno), _join_key(m), m.value
    if t is Abort:
        return m.vbucket, _TWO_SEQNOS.pack(m.prepared_seqno, m.abort_seqno), _join_key(m), m.value
    if t is SeqnoAcknowledged:
        return m.vbucket, _U64.pack(m.prepared_seqno), b"", b""
    if t is SetVbucketState:
        return m.vbucket, bytes([m.state]), b"", b""
    if t is DcpOpen:
        return m.vbucket, _OPEN.pack(m.seqno, m.flags), m.name, m.value
    if t is AddStream:
        return m.vbucket, _U32.pack(m.flags), b"", b""
    if t is Hello:
        return m.vbucket, b"", m.agent, b"".join(_U16.pack(x) for x in m.features)
    if t is HelloResponse:
        return m.status, b"", b"", b"".join(_U16.pack(x) for x in m.features)
    if t is SaslAuth or t is SaslStep:
        return m.vbucket, b"", m.mechanism, m.data
    if t is SelectBucket:
        return m.vbucket, b"", m.bucket, b""
    if t is GetErrorMap:
        return m.vbucket, b"", b"", _U16.pack(m.version)
    if t is GetAllVbSeqnos:
        return m.vbucket, m.extras, b"", b""
    if t is GetAllVbSeqnosResponse:
        return m.status, b"", b"", b"".join(_VB_SEQNO.pack(v, s) for v, s in m.seqnos)
    if isinstance(m, Request):
        return m.vbucket, m.extras, m.key, m.value
    if isinstance(m, Response):
        return m.status, m.extras, m.key, m.value
    raise TypeError(f"cannot encode {type(m).__name__}")


def encode(m: Message) -> bytes:
    vs, extras, key, value = _parts(m)
    fe = encode_frame_infos(m.frame_infos) if m.frame_infos else getattr(m, "raw_framing", b"")
    magic = m.wire_magic()
    return encode_frame(magic, m.op_code, vbucket_or_status=vs, opaque=m.opaque, cas=m.cas,
                        datatype=m.datatype, framing_extras=fe, extras=extras, key=key, value=value)
