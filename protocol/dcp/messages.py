"""Every DCP message (and the memcached commands a DCP connection uses) as a frozen,
slotted dataclass, with decode(frame) -> message, encode(message) -> bytes and
to_row(message) -> dict of CAPTURE_FORMAT columns.

encode(decode(b)) == b for every valid frame: reserved and unused wire fields are kept as
fields. A frame of a known opcode whose layout is wrong decodes to a generic Request or
Response carrying `decode_error`; nothing raises on bad input except framing errors.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

from dcptool.protocol.dcp import leb128
from dcptool.protocol.dcp.constants import (RESPONSE_MAGICS, DatatypeBit,
                                            FrameInfoId, Status, op_name)
from dcptool.protocol.dcp.frames import (Frame, encode_frame, encode_frame_infos,
                                         parse_frame, parse_frame_infos)
from dcptool.protocol.errors import ErrorCode, ProtocolError

_dc = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)


# --------------------------------------------------------------------------- bases

@_dc
class Message:
    opaque: int = 0
    cas: int = 0
    datatype: int = 0
    frame_infos: tuple = ()      # flexible-framing (id, payload) pairs, unknown ids kept
    magic: int | None = None     # None: 0x80 / 0x81, or 0x08 / 0x18 when frame_infos is set

    OPCODE: ClassVar[int] = -1
    IS_RESPONSE: ClassVar[bool] = False

    @property
    def op_code(self) -> int:
        return self.OPCODE

    @property
    def stream_id(self) -> int | None:
        for fid, payload in self.frame_infos:
            if fid == FrameInfoId.DCP_STREAM_ID and len(payload) == 2:
                return int.from_bytes(payload, "big")
        return None

    def wire_magic(self) -> int:
        if self.magic is not None:
            return self.magic
        if self.frame_infos:
            return 0x18 if self.IS_RESPONSE else 0x08
        return 0x81 if self.IS_RESPONSE else 0x80


@_dc
class Request(Message):
    """A request; also the generic form of any request we do not model (or that failed to
    decode: then `decode_error` says why and the parts are kept as sent)."""
    vbucket: int = 0
    opcode: int = -1
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""
    decode_error: str | None = None
    raw_framing: bytes = b""     # framing extras that did not parse, kept as sent

    @property
    def op_code(self) -> int:
        return self.opcode


@_dc
class Response(Message):
    """A response; also the generic form of responses without a special layout."""
    status: int = 0
    opcode: int = -1
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""
    decode_error: str | None = None
    raw_framing: bytes = b""
    IS_RESPONSE: ClassVar[bool] = True

    @property
    def op_code(self) -> int:
        return self.opcode


# --------------------------------------------------------------------------- requests

@_dc
class Hello(Message):
    OPCODE: ClassVar[int] = 0x1F
    vbucket: int = 0
    agent: bytes = b""
    features: tuple[int, ...] = ()


@_dc
class HelloResponse(Message):
    OPCODE: ClassVar[int] = 0x1F
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    features: tuple[int, ...] = ()


@_dc
class SaslListMechs(Message):
    OPCODE: ClassVar[int] = 0x20
    vbucket: int = 0


@_dc
class SaslAuth(Message):
    OPCODE: ClassVar[int] = 0x21
    vbucket: int = 0
    mechanism: bytes = b""
    data: bytes = b""


@_dc
class SaslStep(SaslAuth):
    OPCODE: ClassVar[int] = 0x22


@_dc
class SelectBucket(Message):
    OPCODE: ClassVar[int] = 0x89
    vbucket: int = 0
    bucket: bytes = b""


@_dc
class GetErrorMap(Message):
    OPCODE: ClassVar[int] = 0xFE
    vbucket: int = 0
    version: int = 2


@_dc
class DcpOpen(Message):
    OPCODE: ClassVar[int] = 0x50
    vbucket: int = 0
    name: bytes = b""
    flags: int = 0
    seqno: int = 0          # reserved, sent as 0
    value: bytes = b""      # optional JSON (consumer_name)


@_dc
class AddStream(Message):
    OPCODE: ClassVar[int] = 0x51
    vbucket: int = 0
    flags: int = 0


@_dc
class CloseStream(Message):
    OPCODE: ClassVar[int] = 0x52
    vbucket: int = 0


@_dc
class StreamRequest(Message):
    OPCODE: ClassVar[int] = 0x53
    vbucket: int = 0
    flags: int = 0
    reserved: int = 0
    start_seqno: int = 0
    end_seqno: int = 0xFFFFFFFFFFFFFFFF
    vbucket_uuid: int = 0
    snap_start: int = 0
    snap_end: int = 0
    value: bytes = b""      # optional JSON filter (collections)


@_dc
class StreamRequestResponse(Message):
    """Success carries the failover log; ROLLBACK (0x23) the seqno to roll back to."""
    OPCODE: ClassVar[int] = 0x53
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    failover_log: tuple[tuple[int, int], ...] | None = None  # (vbucket_uuid, seqno), newest first
    rollback_seqno: int | None = None
    value: bytes = b""      # kept for other statuses (error text, or nothing)


@_dc
class GetFailoverLog(Message):
    OPCODE: ClassVar[int] = 0x54
    vbucket: int = 0


@_dc
class FailoverLogResponse(Message):
    OPCODE: ClassVar[int] = 0x54
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    failover_log: tuple[tuple[int, int], ...] | None = None
    value: bytes = b""


@_dc
class StreamEnd(Message):
    OPCODE: ClassVar[int] = 0x55
    vbucket: int = 0
    reason: int = 0


@_dc
class SnapshotMarker(Message):
    """V1: 20-byte extras. V2.x: a 1-byte version extra and the fields in the value
    (V2.0 36 bytes; V2.2 44 bytes, or 52 with the high prepared seqno)."""
    OPCODE: ClassVar[int] = 0x56
    vbucket: int = 0
    snap_version: str = "1"
    snap_start: int = 0
    snap_end: int = 0
    snap_flags: int = 0
    max_visible_seqno: int | None = None
    high_completed_seqno: int | None = None
    purge_seqno: int | None = None
    high_prepared_seqno: int | None = None


@_dc
class _Item(Message):
    vbucket: int = 0
    key: bytes = b""
    collection_id: int | None = None  # None: the key carries no collection prefix
    value: bytes = b""


@_dc
class Mutation(_Item):
    OPCODE: ClassVar[int] = 0x57
    by_seqno: int = 0
    rev_seqno: int = 0
    item_flags: int = 0
    expiration: int = 0
    lock_time: int = 0
    nmeta: int = 0
    nru: int = 0


@_dc
class Deletion(_Item):
    """delete_time None: the V1 layout (nmeta); otherwise V2 (delete time, unused byte)."""
    OPCODE: ClassVar[int] = 0x58
    by_seqno: int = 0
    rev_seqno: int = 0
    delete_time: int | None = None
    nmeta: int = 0
    unused: int = 0


@_dc
class Expiration(_Item):
    OPCODE: ClassVar[int] = 0x59
    by_seqno: int = 0
    rev_seqno: int = 0
    delete_time: int = 0


@_dc
class SetVbucketState(Message):
    OPCODE: ClassVar[int] = 0x5B
    vbucket: int = 0
    state: int = 0


@_dc
class Noop(Message):
    OPCODE: ClassVar[int] = 0x5C
    vbucket: int = 0


@_dc
class BufferAck(Message):
    OPCODE: ClassVar[int] = 0x5D
    vbucket: int = 0
    bytes_acked: int = 0


@_dc
class Control(Message):
    OPCODE: ClassVar[int] = 0x5E
    vbucket: int = 0
    key: bytes = b""
    value: bytes = b""


@_dc
class SystemEvent(Message):
    OPCODE: ClassVar[int] = 0x5F
    vbucket: int = 0
    by_seqno: int = 0
    event_id: int = 0
    version: int = 0
    key: bytes = b""        # the event's name; never collection-prefixed
    value: bytes = b""


@_dc
class Prepare(_Item):
    OPCODE: ClassVar[int] = 0x60
    by_seqno: int = 0
    rev_seqno: int = 0
    item_flags: int = 0
    expiration: int = 0
    lock_time: int = 0
    nru: int = 0
    deleted: int = 0
    durability: int = 0


@_dc
class SeqnoAcknowledged(Message):
    OPCODE: ClassVar[int] = 0x61
    vbucket: int = 0
    prepared_seqno: int = 0


@_dc
class Commit(_Item):
    OPCODE: ClassVar[int] = 0x62
    prepared_seqno: int = 0
    commit_seqno: int = 0


@_dc
class Abort(_Item):
    OPCODE: ClassVar[int] = 0x63
    prepared_seqno: int = 0
    abort_seqno: int = 0


@_dc
class SeqnoAdvanced(Message):
    OPCODE: ClassVar[int] = 0x64
    vbucket: int = 0
    by_seqno: int = 0


@_dc
class OsoSnapshot(Message):
    OPCODE: ClassVar[int] = 0x65
    vbucket: int = 0
    flags: int = 0


@_dc
class GetAllVbSeqnos(Message):
    OPCODE: ClassVar[int] = 0x48
    vbucket: int = 0
    extras: bytes = b""     # optional state (4) or state + collection (8)


@_dc
class GetAllVbSeqnosResponse(Message):
    OPCODE: ClassVar[int] = 0x48
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    seqnos: tuple[tuple[int, int], ...] = ()  # (vbucket, high seqno)


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


class _Bad(Exception):
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


def to_row(m: Message, raw: bytes | None = None, *, value: bool = False) -> dict:
    """CAPTURE_FORMAT columns of a message (only the ones it carries). `raw` adds the frame
    bytes; `value` adds the value bytes under `value` (not a capture column)."""
    magic = m.wire_magic()
    op = m.op_code
    row = {"magic": magic, "opcode": op, "op": op_name(op, magic)}
    if m.IS_RESPONSE:
        row["status"] = getattr(m, "status", 0)
    else:
        row["vbucket"] = getattr(m, "vbucket", 0)
    row["opaque"] = m.opaque
    row["cas"] = m.cas
    row["datatype"] = m.datatype
    sid = m.stream_id
    if sid is not None:
        row["stream_id"] = sid
    t = type(m)
    if isinstance(m, _Item):
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
    if t is SystemEvent and m.event_id in (0, 1, 5) and m.version < 2 and len(m.value) >= 16:
        row["collection_id"] = int.from_bytes(m.value[12:16], "big")   # the collection it is about
    if t is StreamRequestResponse or t is FailoverLogResponse:
        if m.failover_log is not None:
            row["failover_log"] = [{"vbucket_uuid": u, "seqno": s} for u, s in m.failover_log]
    err = getattr(m, "decode_error", None)
    if err is not None:
        row["decode_error"] = err
    if value:
        vattr = "value" if isinstance(m, _Item) else _VALUE_ATTR.get(t)
        if vattr is not None:
            v = getattr(m, vattr)
            # SASL payloads carry credentials: shown as '*' bytes of the same length
            row["value"] = b"*" * len(v) if t is SaslAuth or t is SaslStep else v
    if raw is not None:
        row["raw"] = raw
    return row


def value_bytes(m: Message) -> bytes:
    """The value as stored: Snappy-compressed values (datatype 0x02) are decompressed."""
    v = getattr(m, "value", b"")
    if m.datatype & DatatypeBit.SNAPPY and v:
        import cramjam
        return bytes(cramjam.snappy.decompress_raw(v))
    return v
