"""The wire codec of the DCP messages (message_types.py): decode(frame) -> message,
encode(message) -> bytes. Both are tables: REQUEST_READERS / RESPONSE_READERS from Opcode to
the reader of its layout, WRITERS from message class to its frame parts.

encode(decode(b)) == b for every valid frame. A frame of a known opcode whose layout is
wrong decodes to a generic Request or Response carrying `decode_error`; nothing raises on
bad input except framing errors."""

from __future__ import annotations

from typing import Callable, TypedDict, TypeVar

from dcptool.protocol.dcp.wire import layouts as L
from dcptool.protocol.dcp.wire import leb128
from dcptool.protocol.dcp.wire import message_types as T
from dcptool.protocol.dcp.wire.constants import RESPONSE_MAGICS, Opcode, Status, op_name
from dcptool.protocol.dcp.wire.frames import (
    Frame,
    parse_frame,
    parse_frame_infos,
)
from dcptool.protocol.errors import DcptoolError, ErrorCode, ProtocolError

# --------------------------------------------------------------------------- layouts

SNAPSHOT_VERSIONS = {0: "2.0", 2: "2.2"}

_M = TypeVar("_M", bound=T.Message)


class _Common(TypedDict):
    """The fields every message reads the same way from its frame (`_common`)."""
    opaque: int
    cas: int
    datatype: int
    frame_infos: tuple[tuple[int, bytes], ...]
    magic: int | None


# reader(frame, common, collections) -> the message of a request's frame (REQUEST_READERS)
_Reader = Callable[[Frame, _Common, bool], T.Message]


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
    return tuple(L.PAIR.iter_unpack(value))


def _split_key(key: bytes, collections: bool) -> tuple[int | None, bytes]:
    if not collections:
        return None, key
    try:
        cid, used = leb128.decode(key)
    except ProtocolError as exc:
        raise _Bad(exc.code, exc.message) from None
    return cid, key[used:]


def _common(f: Frame) -> _Common:
    infos = tuple(parse_frame_infos(f.framing_extras)) if f.framing_extras else ()
    default = (0x18 if f.magic in RESPONSE_MAGICS else 0x08) if infos else \
        (0x81 if f.magic in RESPONSE_MAGICS else 0x80)
    return _Common(opaque=f.opaque, cas=f.cas, datatype=f.datatype, frame_infos=infos,
                   magic=None if f.magic == default else f.magic)


def _mutation(f: Frame, c: _Common, collections: bool) -> T.Message:
    ex = f.extras
    _need(ex, 31, "mutation")
    by, rev, fl, exp, lock, nmeta, nru = L.MUTATION.unpack(ex)
    cid, k = _split_key(f.key, collections)
    return T.Mutation(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=f.value, by_seqno=by,
                    rev_seqno=rev, item_flags=fl, expiration=exp, lock_time=lock, nmeta=nmeta, nru=nru, **c)


def _snapshot_marker(f: Frame, c: _Common, collections: bool) -> T.Message:
    ex, val, vb = f.extras, f.value, f.vbucket_or_status
    if len(ex) == 20:
        if val:
            raise _Bad(ErrorCode.BAD_LENGTHS, "snapshot marker V1 carries no value")
        s, e, fl = L.SNAP_V1.unpack(ex)
        return T.SnapshotMarker(vbucket=vb, snap_version="1", snap_start=s, snap_end=e, snap_flags=fl, **c)
    if len(ex) != 1:
        raise _Bad(ErrorCode.BAD_EXTRAS, f"snapshot marker extras of {len(ex)} bytes (want 20 or 1)")
    version = SNAPSHOT_VERSIONS.get(ex[0])
    if version is None:
        raise _Bad(ErrorCode.BAD_EXTRAS, f"snapshot marker version {ex[0]} unknown")
    if version == "2.0":
        if len(val) != 36:
            raise _Bad(ErrorCode.BAD_LENGTHS, f"snapshot marker V2.0 value of {len(val)} bytes (want 36)")
        s, e, fl, mvs, hcs = L.SNAP_V20.unpack(val)
        return T.SnapshotMarker(vbucket=vb, snap_version=version, snap_start=s, snap_end=e, snap_flags=fl,
                              max_visible_seqno=mvs, high_completed_seqno=hcs, **c)
    if len(val) == 44:
        s, e, fl, mvs, hcs, ps = L.SNAP_V22.unpack(val)
        hps = None
    elif len(val) == 52:
        s, e, fl, mvs, hcs, ps, hps = L.SNAP_V22_HPS.unpack(val)
    else:
        raise _Bad(ErrorCode.BAD_LENGTHS, f"snapshot marker V2.2 value of {len(val)} bytes (want 44 or 52)")
    return T.SnapshotMarker(vbucket=vb, snap_version=version, snap_start=s, snap_end=e, snap_flags=fl,
                          max_visible_seqno=mvs, high_completed_seqno=hcs, purge_seqno=ps,
                          high_prepared_seqno=hps, **c)


def _noop(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 0, "noop")
    if f.key or f.value:
        raise _Bad(ErrorCode.BAD_LENGTHS, "noop carries no key or value")
    return T.Noop(vbucket=f.vbucket_or_status, **c)


def _deletion(f: Frame, c: _Common, collections: bool) -> T.Message:
    ex, val, vb = f.extras, f.value, f.vbucket_or_status
    cid, k = _split_key(f.key, collections)
    if len(ex) == 18:
        by, rev, nmeta = L.DELETION_V1.unpack(ex)
        return T.Deletion(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                        nmeta=nmeta, **c)
    if len(ex) == 21:
        by, rev, dt, unused = L.DELETION_V2.unpack(ex)
        return T.Deletion(vbucket=vb, key=k, collection_id=cid, value=val, by_seqno=by, rev_seqno=rev,
                        delete_time=dt, unused=unused, **c)
    raise _Bad(ErrorCode.BAD_EXTRAS, f"deletion needs 18 or 21 extras bytes, got {len(ex)}")


def _expiration(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 20, "expiration")
    by, rev, dt = L.EXPIRATION.unpack(f.extras)
    cid, k = _split_key(f.key, collections)
    return T.Expiration(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=f.value, by_seqno=by,
                      rev_seqno=rev, delete_time=dt, **c)


def _stream_end(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 4, "stream end")
    return T.StreamEnd(vbucket=f.vbucket_or_status, reason=L.U32.unpack(f.extras)[0], **c)


def _stream_request(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 48, "stream request")
    fl, res, st, en, uuid, ss, se = L.STREAM_REQ.unpack(f.extras)
    if f.key:
        raise _Bad(ErrorCode.BAD_LENGTHS, "stream request carries no key")
    return T.StreamRequest(vbucket=f.vbucket_or_status, flags=fl, reserved=res, start_seqno=st, end_seqno=en,
                         vbucket_uuid=uuid, snap_start=ss, snap_end=se, value=f.value, **c)


def _buffer_ack(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 4, "buffer acknowledgement")
    return T.BufferAck(vbucket=f.vbucket_or_status, bytes_acked=L.U32.unpack(f.extras)[0], **c)


def _system_event(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 13, "system event")
    by, ev, ver = L.SYSTEM_EVENT.unpack(f.extras)
    return T.SystemEvent(vbucket=f.vbucket_or_status, by_seqno=by, event_id=ev, version=ver, key=f.key,
                       value=f.value, **c)


def _seqno_advanced(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 8, "seqno advanced")
    return T.SeqnoAdvanced(vbucket=f.vbucket_or_status, by_seqno=L.U64.unpack(f.extras)[0], **c)


def _oso_snapshot(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 4, "oso snapshot")
    return T.OsoSnapshot(vbucket=f.vbucket_or_status, flags=L.U32.unpack(f.extras)[0], **c)


def _prepare(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 31, "prepare")
    by, rev, fl, exp, lock, nru, deleted, dur = L.PREPARE.unpack(f.extras)
    cid, k = _split_key(f.key, collections)
    return T.Prepare(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=f.value, by_seqno=by,
                   rev_seqno=rev, item_flags=fl, expiration=exp, lock_time=lock, nru=nru, deleted=deleted,
                   durability=dur, **c)


def _commit(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 16, op_name(f.opcode))
    p, s = L.TWO_SEQNOS.unpack(f.extras)
    cid, k = _split_key(f.key, collections)
    return T.Commit(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=f.value, prepared_seqno=p,
                  commit_seqno=s, **c)


def _abort(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 16, op_name(f.opcode))
    p, s = L.TWO_SEQNOS.unpack(f.extras)
    cid, k = _split_key(f.key, collections)
    return T.Abort(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=f.value, prepared_seqno=p,
                 abort_seqno=s, **c)


def _seqno_acknowledged(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 8, "seqno acknowledged")
    return T.SeqnoAcknowledged(vbucket=f.vbucket_or_status, prepared_seqno=L.U64.unpack(f.extras)[0], **c)


def _set_vbucket_state(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 1, "set vbucket state")
    return T.SetVbucketState(vbucket=f.vbucket_or_status, state=f.extras[0], **c)


def _control(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 0, "control")
    return T.Control(vbucket=f.vbucket_or_status, key=f.key, value=f.value, **c)


def _open(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 8, "open")
    seq, fl = L.OPEN.unpack(f.extras)
    return T.DcpOpen(vbucket=f.vbucket_or_status, name=f.key, flags=fl, seqno=seq, value=f.value, **c)


def _add_stream(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 4, "add stream")
    return T.AddStream(vbucket=f.vbucket_or_status, flags=L.U32.unpack(f.extras)[0], **c)


def _bare(cls: type[T.CloseStream | T.GetFailoverLog | T.SaslListMechs]) -> _Reader:
    """The reader of a request that carries nothing but its vbucket."""
    def read(f: Frame, c: _Common, collections: bool) -> T.Message:
        _need(f.extras, 0, op_name(f.opcode))
        if f.key or f.value:
            raise _Bad(ErrorCode.BAD_LENGTHS, f"{op_name(f.opcode)} carries no key or value")
        return cls(vbucket=f.vbucket_or_status, **c)
    return read


def _hello(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 0, "hello")
    if len(f.value) % 2:
        raise _Bad(ErrorCode.BAD_LENGTHS, "hello features are not a list of u16")
    return T.Hello(vbucket=f.vbucket_or_status, agent=f.key,
                 features=tuple(x for (x,) in L.U16.iter_unpack(f.value)), **c)


def _sasl(cls: type[T.SaslAuth]) -> _Reader:
    def read(f: Frame, c: _Common, collections: bool) -> T.Message:
        _need(f.extras, 0, op_name(f.opcode))
        return cls(vbucket=f.vbucket_or_status, mechanism=f.key, data=f.value, **c)
    return read


def _select_bucket(f: Frame, c: _Common, collections: bool) -> T.Message:
    _need(f.extras, 0, "select bucket")
    if f.value:
        raise _Bad(ErrorCode.BAD_LENGTHS, "select bucket carries no value")
    return T.SelectBucket(vbucket=f.vbucket_or_status, bucket=f.key, **c)


def _get_error_map(f: Frame, c: _Common, collections: bool) -> T.Message:
    if f.extras or f.key or len(f.value) != 2:
        raise _Bad(ErrorCode.BAD_LENGTHS, "get error map carries a 2-byte version only")
    return T.GetErrorMap(vbucket=f.vbucket_or_status, version=L.U16.unpack(f.value)[0], **c)


def _get_all_vb_seqnos(f: Frame, c: _Common, collections: bool) -> T.Message:
    if f.key or f.value or len(f.extras) not in (0, 4, 8):
        raise _Bad(ErrorCode.BAD_EXTRAS, "get all vb seqnos takes 0, 4 or 8 extras bytes only")
    return T.GetAllVbSeqnos(vbucket=f.vbucket_or_status, extras=f.extras, **c)


def _with_meta(cls: type[T.SetWithMeta]) -> _Reader:   # extras 24, 26 (+ meta length), 28 (+ options), 30 (+ both); the meta ends the value
    def read(f: Frame, c: _Common, collections: bool) -> T.Message:
        ex, n = f.extras, len(f.extras)
        if n not in (24, 26, 28, 30):
            raise _Bad(ErrorCode.BAD_EXTRAS, f"{op_name(f.opcode)} needs 24, 26, 28 or 30 extras bytes, got {n}")
        fl, exp, rev, cas = L.WITH_META.unpack_from(ex)
        options, ext, value = L.U32.unpack_from(ex, 24)[0] if n >= 28 else None, None, f.value
        if n in (26, 30):
            size = L.U16.unpack_from(ex, n - 2)[0]
            if size > len(value):
                raise _Bad(ErrorCode.BAD_LENGTHS, f"extended meta of {size} bytes in a value of {len(value)}")
            value, ext = value[:len(value) - size], value[len(value) - size:]
        cid, k = _split_key(f.key, collections)
        return cls(vbucket=f.vbucket_or_status, key=k, collection_id=cid, value=value, item_flags=fl,
                   expiration=exp, rev_seqno=rev, meta_cas=cas, options=options, ext_meta=ext, **c)
    return read


def _get_meta(f: Frame, c: _Common, collections: bool) -> T.Message:
    if len(f.extras) > 1 or f.value:
        raise _Bad(ErrorCode.BAD_EXTRAS, "get meta takes a 1-byte version at most and no value")
    cid, k = _split_key(f.key, collections)
    return T.GetMeta(vbucket=f.vbucket_or_status, key=k, collection_id=cid,
                   version=f.extras[0] if f.extras else None, **c)


# opcode -> reader of a request (magic 0x80 / 0x82 / 0x08): reader(frame, common, collections)
# gives the message, raises _Bad for a wrong layout; an opcode not here is a generic T.Request
REQUEST_READERS: dict[int, _Reader] = {
    Opcode.DCP_MUTATION: _mutation,
    Opcode.DCP_SNAPSHOT_MARKER: _snapshot_marker,
    Opcode.DCP_NOOP: _noop,
    Opcode.DCP_DELETION: _deletion,
    Opcode.DCP_EXPIRATION: _expiration,
    Opcode.DCP_STREAM_END: _stream_end,
    Opcode.DCP_STREAM_REQ: _stream_request,
    Opcode.DCP_BUFFER_ACK: _buffer_ack,
    Opcode.DCP_SYSTEM_EVENT: _system_event,
    Opcode.DCP_SEQNO_ADVANCED: _seqno_advanced,
    Opcode.DCP_OSO_SNAPSHOT: _oso_snapshot,
    Opcode.DCP_PREPARE: _prepare,
    Opcode.DCP_COMMIT: _commit,
    Opcode.DCP_ABORT: _abort,
    Opcode.DCP_SEQNO_ACK: _seqno_acknowledged,
    Opcode.DCP_SET_VBUCKET_STATE: _set_vbucket_state,
    Opcode.DCP_CONTROL: _control,
    Opcode.DCP_OPEN: _open,
    Opcode.DCP_ADD_STREAM: _add_stream,
    Opcode.DCP_CLOSE_STREAM: _bare(T.CloseStream),
    Opcode.DCP_GET_FAILOVER_LOG: _bare(T.GetFailoverLog),
    Opcode.SASL_LIST_MECHS: _bare(T.SaslListMechs),
    Opcode.HELLO: _hello,
    Opcode.SASL_AUTH: _sasl(T.SaslAuth),
    Opcode.SASL_STEP: _sasl(T.SaslStep),
    Opcode.SELECT_BUCKET: _select_bucket,
    Opcode.GET_ERROR_MAP: _get_error_map,
    Opcode.GET_ALL_VB_SEQNOS: _get_all_vb_seqnos,
    Opcode.GET_META: _get_meta,
    Opcode.SET_WITH_META: _with_meta(T.SetWithMeta),
    Opcode.ADD_WITH_META: _with_meta(T.AddWithMeta),
    Opcode.DEL_WITH_META: _with_meta(T.DelWithMeta),
}


def _stream_request_response(f: Frame, c: _Common) -> T.Message | None:
    st, val = f.vbucket_or_status, f.value
    if f.extras or f.key:
        return None
    if st == Status.SUCCESS:
        return T.StreamRequestResponse(status=st, failover_log=_pairs(val, "failover log"), **c)
    if st == Status.ROLLBACK:
        if len(val) != 8:
            raise _Bad(ErrorCode.BAD_LENGTHS, f"rollback answer of {len(val)} bytes (want 8)")
        return T.StreamRequestResponse(status=st, rollback_seqno=L.U64.unpack(val)[0], **c)
    return T.StreamRequestResponse(status=st, value=val, **c)


def _failover_log_response(f: Frame, c: _Common) -> T.Message | None:
    if f.extras or f.key:
        return None
    if f.vbucket_or_status == Status.SUCCESS:
        return T.FailoverLogResponse(status=f.vbucket_or_status, failover_log=_pairs(f.value, "failover log"), **c)
    return T.FailoverLogResponse(status=f.vbucket_or_status, value=f.value, **c)


def _hello_response(f: Frame, c: _Common) -> T.Message | None:
    if f.vbucket_or_status != Status.SUCCESS or f.extras or f.key or len(f.value) % 2:
        return None
    return T.HelloResponse(status=f.vbucket_or_status, features=tuple(x for (x,) in L.U16.iter_unpack(f.value)), **c)


def _vb_seqnos_response(f: Frame, c: _Common) -> T.Message | None:
    if f.vbucket_or_status != Status.SUCCESS or f.extras or f.key:
        return None
    if len(f.value) % 10:
        raise _Bad(ErrorCode.BAD_LENGTHS, "vb seqnos are not a list of 10-byte entries")
    return T.GetAllVbSeqnosResponse(status=f.vbucket_or_status, seqnos=tuple(L.VB_SEQNO.iter_unpack(f.value)), **c)


def _get_meta_response(f: Frame, c: _Common) -> T.Message | None:
    if f.vbucket_or_status != Status.SUCCESS or f.key or f.value or len(f.extras) not in (20, 21):
        return None
    deleted, fl, exp, rev = L.META.unpack_from(f.extras)
    return T.GetMetaResponse(status=f.vbucket_or_status, deleted=deleted, item_flags=fl, expiration=exp, rev_seqno=rev,
                           item_datatype=f.extras[20] if len(f.extras) == 21 else None, **c)


# opcode -> reader of a response: the message, or None for the generic T.Response
RESPONSE_READERS: dict[int, Callable[[Frame, _Common], T.Message | None]] = {
    Opcode.DCP_STREAM_REQ: _stream_request_response,
    Opcode.DCP_GET_FAILOVER_LOG: _failover_log_response,
    Opcode.HELLO: _hello_response,
    Opcode.GET_ALL_VB_SEQNOS: _vb_seqnos_response,
    Opcode.GET_META: _get_meta_response,
}


def decode(frame: Frame, collections: bool = False) -> T.Message:
    """The message in a whole frame. Never raises: a wrong layout gives a generic
    T.Request/T.Response with decode_error set."""
    try:
        c = _common(frame)
    except ProtocolError as exc:
        return _generic(frame, None, f"{exc.code.name.lower()}: {exc.message}")
    try:
        msg: T.Message | None
        if frame.magic in RESPONSE_MAGICS:
            read_response = RESPONSE_READERS.get(frame.opcode)
            msg = None if read_response is None else read_response(frame, c)
        else:
            read_request = REQUEST_READERS.get(frame.opcode)
            msg = None if read_request is None else read_request(frame, c, collections)
    except _Bad as bad:
        return _generic(frame, c, str(bad))
    return msg if msg is not None else _generic(frame, c, None)


def _generic(f: Frame, c: _Common | None, error: str | None) -> T.Message:
    raw_framing = b""
    if c is None:  # framing extras that do not parse are kept raw
        c = _Common(opaque=f.opaque, cas=f.cas, datatype=f.datatype, frame_infos=(), magic=f.magic)
        raw_framing = f.framing_extras
    if f.magic in RESPONSE_MAGICS:
        return T.Response(status=f.vbucket_or_status, opcode=f.opcode, extras=f.extras, key=f.key,
                        value=f.value, decode_error=error, raw_framing=raw_framing, **c)
    return T.Request(vbucket=f.vbucket_or_status, opcode=f.opcode, extras=f.extras, key=f.key,
                   value=f.value, decode_error=error, raw_framing=raw_framing, **c)


def decode_bytes(data: bytes, collections: bool = False) -> T.Message:
    """Decode exactly one whole frame given as bytes."""
    return decode(parse_frame(data, 0, len(data)), collections)
